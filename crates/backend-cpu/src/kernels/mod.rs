//! Reference kernels (placeholder: being written).
use crate::memory::Mem;
use lowsync_backend::{ExecNode, Result};

/// Runs one compute node.
pub fn run_node(node: &ExecNode, mem: &dyn Mem) -> Result<()> {
    let _ = (node, mem);
    Ok(())
}
