//! Events, readbacks and the test gate: points in the stream the host or another stream can
//! wait on.
//!
//! Why: the scheduler orders work across backends with events (`event_record` on one stream,
//! `event_wait` on another) and tests order it with a gate; neither may cost a host wait or a
//! submission that the step would not make anyway.
//!
//! Strategy: an event is a retire point (compute and transfer timeline values) taken after
//! submitting open work; it is complete when the host saw, or a non-blocking query finds, both
//! values reached. The gate is a timeline semaphore the host signals to 1; the next compute
//! submission waits on it. Another backend's event is bridged by a helper thread that polls it
//! and signals such a semaphore, so the waiting stream waits on the device, not the host.
//!
//! Invariants: waiting on this stream's own event is stream order (nothing to do); a host
//! semaphore is destroyed only once signalled and no pending submission waits on it.

use std::any::Any;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ash::vk;
use lowsync_backend::{Error, Event, Gate, Readback, Result};
use parking_lot::Mutex;

use crate::device::unavailable;
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
    /// Orders later work of this stream after `ev` without blocking the host.
    pub(crate) fn event_wait(self: &Arc<Self>, ev: &Arc<dyn Event>) -> Result<()> {
        let inner = self;
        let own = ev
            .as_any()
            .downcast_ref::<VkEvent>()
            .is_some_and(|e| Arc::ptr_eq(&e.owner, inner));
        if own || ev.is_complete() {
            return Ok(()); // stream order, or nothing to wait for
        }
        // Another stream's event: a helper thread signals a semaphore the next submission
        // waits on, so the host thread does not block.
        let mut st = inner.state.lock();
        let sem = create_timeline(inner.device())?;
        let signaled = Arc::new(AtomicBool::new(false));
        st.signals.push(HostSignal {
            sem,
            signaled: signaled.clone(),
            last_waited: Retire::default(),
            pending: true,
        });
        drop(st);
        let owner = inner.clone();
        let ev = ev.clone();
        std::thread::Builder::new()
            .name(format!("lowsync-{}-bridge", inner.name))
            .spawn(move || {
                let mut pause = Duration::from_micros(20);
                while !ev.is_complete() {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
                let _guard = owner.state.lock();
                signal_once(owner.device(), sem, &signaled);
            })
            .map_err(|e| unavailable(format!("cannot start an event bridge thread: {e}")))?;
        Ok(())
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
