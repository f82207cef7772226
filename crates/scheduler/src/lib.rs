//! lowsync-scheduler: from a graph to work on backends.
//!
//! This round: the graph allocator ([`alloc`]) and the single-backend executor ([`Plan`]) with
//! the three [`SyncPolicy`]s applied to the plan's one split. Placement across backends and
//! splits come with the scheduler issue and build on the same pieces.

pub mod alloc;
mod error;
mod plan;
mod policy;

pub use alloc::{AllocPlan, Region};
pub use error::{Error, Result};
pub use plan::{check_support, InputSlot, OutputSlot, Plan};
pub use policy::SyncPolicy;
