//! `rollout_store`'s data plane: the capture server's model routes served by hyper on tokio,
//! with no Python in it.
//!
//! - [`checks`]: the gate every model call passes first (its `Host`, `Origin` and
//!   `Content-Type`, its key), with the refusals in the shapes the Python server answers;
//! - [`keys`]: the table of session keys the control plane keeps current, compared in
//!   constant time;
//! - [`depth`]: the depth check a body passes before it goes upstream;
//! - [`direct`]: which `--ack fast` calls the data plane sends upstream by itself, and the
//!   bytes it sends;
//! - [`ledger`]: the `--ack fast` ledger's file, which the control plane and the direct lane
//!   append to through one appender;
//! - [`sse`]: the upstream's event stream split into events as it passes through, its last
//!   event told apart, capture fields the client did not ask for taken out;
//! - [`plane`]: the listener, the pooled upstream client, the reverse proxy to the control
//!   plane and the recorder thread, owned by a [`Gateway`] its owner stops.

pub mod checks;
pub mod depth;
pub mod direct;
pub mod keys;
pub mod ledger;
pub mod plane;
pub mod sse;

pub use keys::Handle;
pub use ledger::{Answered, Ledger};
pub use plane::{
    Call, Config, Control, Direct, DirectLane, Finished, Gateway, Prepared, Queued, Reply, Sent,
    Streamed, Streaming, Upstream,
};
