//! A graph plan: the commands of one graph as data, with the barriers hazard tracking places
//! between them.
//!
//! Why: a decode step runs the same graph on the same buffers every token. Checking and
//! planning its few hundred nodes (kernel variants, descriptor sets, push constants, barrier
//! positions) costs more host time than recording them, so it is done once and the result is
//! kept as plain data; recording it again every step costs host time too, so a cached plan is
//! recorded once into a command buffer of its own that every later step replays.
//!
//! Strategy: every command declares the byte ranges it reads and writes ([`Access`], the same
//! ranges its bindings cover, so the synchronization validation layer sees what the tracker
//! sees). While a plan is built, a [`Tracker`] puts a global barrier before a command that
//! conflicts (same buffer, overlapping bytes, at least one write) with any command since the
//! last barrier. A [`GraphPlan`] records the graph it was built for (weakly) and the buffer
//! generation, so a freed or replaced buffer retires it. Nothing a step changes is in a plan:
//! push constants hold shapes, strides, offsets and an error tag, all fixed by the graph, and
//! descriptor sets bind fixed buffer ranges; the per-step values of a decode step (token ids,
//! positions, KV slots, the mask or valid length) are tensors in device memory the staged copy
//! writes. That is what makes a [`CachedPlan`]'s [`RecordedPlan`] replayable unchanged.
//!
//! Invariant: two commands of a plan that conflict always have a barrier between them; a plan
//! holds only handles that live as long as its generation is current; a recorded plan's command
//! buffer is freed only once the last submission that executes it completed.

use std::sync::{Arc, Weak};

use ash::vk;
use lowsync_backend::ExecGraph;

use crate::pipelines::{Bind, Push};

/// A byte range a recorded command touches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Access {
    pub buffer: vk::Buffer,
    pub start: u64,
    pub end: u64,
    pub write: bool,
}

impl Access {
    pub(crate) fn conflicts(&self, o: &Access) -> bool {
        self.buffer == o.buffer
            && (self.write || o.write)
            && self.start < o.end
            && o.start < self.end
    }
}

/// One command of a graph plan, ready to record.
#[derive(Clone, Debug)]
pub(crate) enum Recorded {
    /// A global barrier between conflicting commands.
    Barrier,
    Copy {
        src: (vk::Buffer, u64),
        dst: (vk::Buffer, u64),
        size: u64,
    },
    Dispatch {
        pipeline: vk::Pipeline,
        layout: vk::PipelineLayout,
        set: vk::DescriptorSet,
        push: Push,
        groups: [u32; 3],
        /// The kernel variant (what a profile reports it as).
        kernel: Arc<str>,
        /// Bytes its bindings read.
        read_bytes: u64,
    },
}

impl Recorded {
    /// The ranges this command touches (`binds` for a dispatch).
    pub(crate) fn accesses(&self, binds: &[Bind]) -> Vec<Access> {
        match self {
            Recorded::Barrier => Vec::new(),
            Recorded::Copy { src, dst, size } => vec![
                Access {
                    buffer: src.0,
                    start: src.1,
                    end: src.1 + size,
                    write: false,
                },
                Access {
                    buffer: dst.0,
                    start: dst.1,
                    end: dst.1 + size,
                    write: true,
                },
            ],
            Recorded::Dispatch { .. } => binds
                .iter()
                .map(|b| Access {
                    buffer: b.buffer,
                    start: b.offset,
                    end: b.offset + b.range,
                    write: b.write,
                })
                .collect(),
        }
    }
}

/// Places barriers while a plan is built: a command that conflicts with one since the last
/// barrier gets a barrier before it.
#[derive(Default)]
pub(crate) struct Tracker {
    since_barrier: Vec<Access>,
}

impl Tracker {
    pub(crate) fn push(&mut self, steps: &mut Vec<Recorded>, acc: Vec<Access>, step: Recorded) {
        let conflict = acc
            .iter()
            .any(|a| self.since_barrier.iter().any(|b| a.conflicts(b)));
        if conflict {
            steps.push(Recorded::Barrier);
            self.since_barrier.clear();
        }
        self.since_barrier.extend(acc);
        steps.push(step);
    }
}

/// A graph checked and planned once, replayed while the graph and its buffers are unchanged.
pub(crate) struct GraphPlan {
    pub graph: Weak<ExecGraph>,
    /// `State::generation` when planned (bumped whenever a buffer is freed or replaced).
    pub generation: u64,
    pub steps: Vec<Recorded>,
    pub sites: Vec<(u32, ErrorSite)>,
    /// False when the plan uses per-submission scratch memory.
    pub replayable: bool,
}

/// What an index error reported by a kernel refers to.
#[derive(Clone, Debug)]
pub(crate) struct ErrorSite {
    pub op: &'static str,
    pub node: String,
    pub what: &'static str,
    pub rows_of: &'static str,
    pub n: usize,
}

/// A plan kept for replay, and its commands recorded once (`LOWSYNC_VK_RECORD`, on by default).
pub(crate) struct CachedPlan {
    pub plan: Arc<GraphPlan>,
    /// Recorded at the plan's first use; `None` until then, or when recording is off.
    pub recorded: Option<RecordedPlan>,
}

/// A plan's commands in a secondary command buffer begun with SIMULTANEOUS_USE (steps in flight
/// together execute the same buffer), executed from the stream's open primary buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordedPlan {
    pub cmd: vk::CommandBuffer,
    /// The compute timeline value of the last submission that executes it.
    pub last_used: u64,
}
