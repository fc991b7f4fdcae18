//! `rollout_store._core`: the engine's Python bindings. Argument conversion only; the work is
//! in the engine crate.

mod content;
mod data_plane;
mod frames;
mod json;
mod packed;

use pyo3::prelude::*;

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

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::content::ContentTable;
    #[pymodule_export]
    use super::data_plane::DataPlane;
    #[pymodule_export]
    use super::frames::{
        encode_blob_frame, encode_frame, frame_chain_value, next_frame, read_gap, FrameScan,
    };
    #[pymodule_export]
    use super::json::{dumps, loads};
    #[pymodule_export]
    use super::packed::{unpack, Packer};
    #[pymodule_export]
    use super::{DecodeError, FrameTooLarge, RefusedValue};

    #[pymodule_export]
    const MAX_DEPTH: usize = super::packed::MAX_DEPTH;

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");

    #[pymodule_export]
    const DEFAULT_MAX_DEPTH: usize = engine::json::DEFAULT_MAX_DEPTH;
}
