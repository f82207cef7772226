//! lowsync-scheduler: from a graph to work on backends.
//!
//! - [`placement`]: which backend runs each node (ggml's passes, one function each).
//! - [`split`]: runs of nodes on one backend and the inputs each receives.
//! - [`alloc`]: liveness-based scratch planning.
//! - [`Sched`]: a context's backends, shared memory and worst-case reserve (debug-realloc).
//! - [`Plan`]: one compiled graph and the compute loop under a [`SyncPolicy`].

pub mod alloc;
mod analysis;
mod error;
pub mod placement;
mod plan;
mod policy;
mod sched;
pub mod split;

pub use analysis::{analyze, Analysis, ItemKey};
pub use error::{Error, Result};
pub use plan::{InputSlot, OutputSlot, Plan};
pub use policy::SyncPolicy;
pub use sched::{debug_realloc_from_env, Sched, MAX_COPIES};
