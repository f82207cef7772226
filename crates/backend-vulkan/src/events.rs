//! Events, readbacks and the test gate: points in the stream the host or another stream can
//! wait on.
//!
//! Why: the scheduler orders work across backends with events (`event_record` on one stream,
//! `event_wait` on another) and tests order it with a gate; neither may cost a host wait or a
//! submission that the step would not make anyway, and every wait that does happen is counted
//! where it blocks, the same way whatever had finished by then (issue 29.14).
//!
//! Strategy: an event is a retire point (compute and transfer timeline values) taken after
//! submitting open work; it is complete when the host saw, or a non-blocking query finds, both
//! values reached. The gate is a timeline semaphore the host signals to 1; the next compute
//! submission waits on it. An event of this stream needs no wait (stream order). An event of
//! another backend is waited for by the host at the call, through that event's own
//! `synchronize` — one host wait counted by its backend, or an elided sync where its host
//! already saw it complete — as ggml's scheduler falls back to `event_synchronize` where a
//! backend cannot wait on another's event, and as `cpu-async` and CUDA treat events of another
//! kind.
//!
//! Why not a device-side wait on a foreign event: the queue cannot wait on another backend's
//! stream directly; it needs a semaphore that something on the host signals when the event
//! completes. The previous bridge — a thread per foreign event sleep-polling `is_complete` (up
//! to 2 ms) — stalled the queue on a host thread for a time nobody counted, and whether it
//! waited at all depended on timing. A completion callback in the `Event` contract that signals
//! the semaphore would avoid the host block, but it needs every backend's completion path to
//! run foreign code (lock order across backends, callbacks outliving a dropped backend) for a
//! pairing only tests use (`vulkan` with `cpu-async`); the mixed graphs lowsync runs place CPU
//! ops on `cpu`, whose events are complete when recorded. The host wait is exact, counted by
//! the backend that owns the work, and needs no thread.
//!
//! Invariants: waiting on this stream's own event is stream order (nothing to do); a foreign
//! event's wait happens at the call, once per call, whatever its state; a host semaphore (a
//! gate) is destroyed only once signalled and no pending submission waits on it.

use std::any::Any;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};

use ash::vk;
use lowsync_backend::{Error, Event, Gate, Readback, Result};
use parking_lot::Mutex;

use crate::stream::{signal_once, HostSignal};
use crate::sync::Inner;
use crate::timeline::{create_timeline, Retire};

/// A point in a Vulkan stream.
pub struct VkEvent {
    owner: Arc<Inner>,
    point: Mutex<Retire>,
}

impl Event for VkEvent {
    fn is_complete(&self) -> bool {
        let p = *self.point.lock();
        let mut st = self.owner.state.lock();
        if p.done_by(Retire {
            compute: st.compute.observed,
            transfer: st.transfer.as_ref().map_or(0, |t| t.tl.observed),
        }) {
            return true;
        }
        st.poll(self.owner.device());
        p.done_by(st.completed())
    }
    fn synchronize(&self) -> Result<()> {
        let p = *self.point.lock();
        self.owner.wait_point(p)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A read of a Vulkan stream: its bytes land in `into` at the wait that observes `point`.
pub(crate) struct VkReadback {
    pub owner: Arc<Inner>,
    pub point: Retire,
    pub into: Arc<Mutex<Vec<u8>>>,
    pub bytes: Option<Vec<u8>>,
}

impl Readback for VkReadback {
    fn is_complete(&self) -> bool {
        if self.bytes.is_some() {
            return true;
        }
        let mut st = self.owner.state.lock();
        st.poll(self.owner.device());
        self.point.done_by(st.completed())
    }
    fn wait(&mut self) -> Result<&[u8]> {
        if self.bytes.is_none() {
            self.owner.wait_point(self.point)?;
            self.bytes = Some(std::mem::take(&mut *self.into.lock()));
        }
        Ok(self.bytes.as_deref().unwrap_or_default())
    }
}

/// The Vulkan test gate: a timeline semaphore the host signals.
pub struct VkGate {
    owner: Weak<Inner>,
    sem: vk::Semaphore,
    signaled: Arc<AtomicBool>,
}

impl Gate for VkGate {
    fn open(&self) {
        if let Some(inner) = self.owner.upgrade() {
            let _guard = inner.state.lock();
            signal_once(inner.device(), self.sem, &self.signaled);
        }
    }
}

impl Inner {
    /// A new event, at the start of the stream (complete).
    pub(crate) fn event_new(self: &Arc<Self>) -> Result<Arc<dyn Event>> {
        Ok(Arc::new(VkEvent {
            owner: self.clone(),
            point: Mutex::new(Retire::default()),
        }))
    }
    /// Moves `ev` to the end of the stream; open work is submitted so it completes alone.
    pub(crate) fn event_record(self: &Arc<Self>, ev: &Arc<dyn Event>) -> Result<()> {
        let inner = self;
        let e = ev
            .as_any()
            .downcast_ref::<VkEvent>()
            .filter(|e| Arc::ptr_eq(&e.owner, inner));
        let Some(e) = e else {
            return Err(Error::Unsupported {
                backend: inner.name.clone(),
                what: "recording another backend's event".into(),
            });
        };
        let mut st = inner.state.lock();
        // The event must complete without another call: open work is submitted now.
        st.submit_open(&inner.dev, &inner.stats, vk::Fence::null())?;
        *e.point.lock() = st.end_point();
        Ok(())
    }
    /// Orders later work of this stream after `ev`: stream order for an own event, else a host
    /// wait at the call through the event's `synchronize` (counted by its backend).
    pub(crate) fn event_wait(self: &Arc<Self>, ev: &Arc<dyn Event>) -> Result<()> {
        let own = ev
            .as_any()
            .downcast_ref::<VkEvent>()
            .is_some_and(|e| Arc::ptr_eq(&e.owner, self));
        if own {
            return Ok(()); // stream order
        }
        // Never `is_complete` first: whether the call waits must not depend on timing.
        ev.synchronize()
    }

    /// A closed test gate: the next compute submission waits until it opens.
    pub(crate) fn gate_close(self: &Arc<Self>) -> Result<Arc<dyn Gate>> {
        let inner = self;
        let mut st = inner.state.lock();
        // Work queued before the gate is not held back by it.
        st.submit_open(&inner.dev, &inner.stats, vk::Fence::null())?;
        let sem = create_timeline(inner.device())?;
        let signaled = Arc::new(AtomicBool::new(false));
        st.signals.push(HostSignal {
            sem,
            signaled: signaled.clone(),
            last_waited: Retire::default(),
            pending: true,
        });
        Ok(Arc::new(VkGate {
            owner: Arc::downgrade(inner),
            sem,
            signaled,
        }))
    }
}
