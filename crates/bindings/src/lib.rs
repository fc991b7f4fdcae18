//! `rollout_store._core`: the engine's Python bindings. Argument conversion only; the work is
//! in the engine crate.

mod content;
mod data_plane;
mod frames;
mod hashing;
mod json;
mod key_index;
mod packed;
mod requests;
mod sized_index;

use pyo3::prelude::*;

/// Work over at least this many bytes (hashing, encoding, checking) runs with the GIL
/// released. Below it the GIL is kept: a thread that lets the GIL go must win it back, and
/// while other threads run Python (the data plane's callbacks, a server's calls) that can
/// take a whole switch interval (5 ms by default), for work that takes well under one: 1 MiB
/// is about 0.1 ms of BLAKE3 or xxh3.
pub(crate) const DETACH_FROM: usize = 1 << 20;

pyo3::create_exception!(
    rollout_store._core,
    DecodeError,
    pyo3::exceptions::PyValueError,
    "JSON text that is not JSON (or nested too deeply); `offset` is the byte it was found at."
);

pyo3::create_exception!(
    rollout_store._core,
    RefusedValue,
    pyo3::exceptions::PyValueError,
    "A value the library cannot record: `args` are the message and the path inside the value."
);

pyo3::create_exception!(
    rollout_store._core,
    FrameTooLarge,
    pyo3::exceptions::PyValueError,
    "A record or string larger than a frame can hold (the message says which and its size)."
);

pyo3::create_exception!(
    rollout_store._core,
    Unconfirmed,
    pyo3::exceptions::PyLookupError,
    "The base of a request is undecided: it may extend a turn read from a file by its key alone. \
`args` are the message, that turn, its message count and the request's digest there: compare \
the bytes, then `confirm` the turn with that digest, or pass it in `refuted`."
);

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::content::ContentTable;
    #[pymodule_export]
    use super::data_plane::{answer_reply, body_too_deep, direct_tail, DataPlane, PyLedger};
    #[pymodule_export]
    use super::frames::{
        encode_blob_frame, encode_blob_frame_v1, encode_frame, encode_frame_v1, frame_chain_value,
        intact_end_after_v1, next_frame, read_gap, AsciiText, FrameScan,
    };
    #[pymodule_export]
    use super::hashing::{json_fields, json_member_ids, json_u32_ids, u32_ids, Blake3};
    #[pymodule_export]
    use super::json::{dumps, loads};
    #[pymodule_export]
    use super::key_index::KeyNumbers;
    #[pymodule_export]
    use super::packed::{check_packed, splice, unpack, Packer};
    #[pymodule_export]
    use super::requests::{link_echoes, PendingTip, RequestTable};
    #[pymodule_export]
    use super::sized_index::SizedIndex;
    #[pymodule_export]
    use super::{DecodeError, FrameTooLarge, RefusedValue, Unconfirmed};

    #[pymodule_export]
    const MAX_DEPTH: usize = super::packed::MAX_DEPTH;

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");

    #[pymodule_export]
    const DEFAULT_MAX_DEPTH: usize = engine::json::DEFAULT_MAX_DEPTH;

    // the file format's constants, written once: the Python file layer reads them from here
    #[pymodule_export]
    const MAGIC_V1: &[u8] = engine::file::frames_v1::MAGIC_V1;
    #[pymodule_export]
    const MAGIC_V2: &[u8] = engine::file::frames::MAGIC_V2;
    #[pymodule_export]
    const ESCAPE: &[u8] = &engine::file::frames::ESCAPE;
    #[pymodule_export]
    const SYNC: &[u8] = &engine::file::frames::SYNC;
    #[pymodule_export]
    const ESCAPED: u8 = engine::file::frames::ESCAPED;
    #[pymodule_export]
    const HEADER_LAYOUT: &str = engine::file::frames::HEADER_LAYOUT;
    #[pymodule_export]
    const HEADER_SIZE: usize = engine::file::frames::HEADER_SIZE;
    #[pymodule_export]
    const HEADER_LAYOUT_V1: &str = engine::file::frames_v1::HEADER_LAYOUT_V1;
    #[pymodule_export]
    const HEADER_SIZE_V1: usize = engine::file::frames_v1::HEADER_SIZE_V1;
    #[pymodule_export]
    const MAX_PAYLOAD: usize = engine::file::frames::MAX_PAYLOAD;
    #[pymodule_export]
    const MAX_PAYLOAD_V1: usize = engine::file::frames_v1::MAX_PAYLOAD_V1;
    #[pymodule_export]
    const DIGEST_SIZE: usize = engine::file::frames::DIGEST_SIZE;
    #[pymodule_export]
    const BLOB_PREFIX_V1: &[u8] = &engine::file::frames_v1::BLOB_PREFIX_V1;
}
