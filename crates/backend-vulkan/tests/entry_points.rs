//! The counters against an independent count: the Vulkan entry points are wrapped where the
//! loader hands them out (`VkConfig::entry_point_hook`), outside lowsync's code, and every
//! `vkQueueSubmit` (empty or not) and every wait (`vkWaitSemaphores`, `vkWaitForFences`
//! calls that end the wait) is counted by the wrappers. Over a long mixed sequence on both memory
//! paths, with and without the legacy switch, the two counts agree. (Kept alone in this test
//! binary: the wrapper counts are process-wide.)

mod common;

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use ash::vk;
use lowsync_backend::{Backend, BufferUsage};
use lowsync_cpu::CpuBackend;
use lowsync_vulkan::VkConfig;

static SUBMITS: AtomicU64 = AtomicU64::new(0);
static EMPTY_SUBMITS: AtomicU64 = AtomicU64::new(0);
static WAITS: AtomicU64 = AtomicU64::new(0);
static REAL_SUBMIT: AtomicUsize = AtomicUsize::new(0);
static REAL_WAIT_SEMAPHORES: AtomicUsize = AtomicUsize::new(0);
static REAL_WAIT_FENCES: AtomicUsize = AtomicUsize::new(0);

unsafe extern "system" fn queue_submit(
    queue: vk::Queue,
    count: u32,
    submits: *const vk::SubmitInfo<'_>,
    fence: vk::Fence,
) -> vk::Result {
    // A batch carries work when some submit info has a command buffer.
    let work = (0..count as usize).any(|i| unsafe { (*submits.add(i)).command_buffer_count } > 0);
    SUBMITS.fetch_add(1, Ordering::Relaxed);
    if !work {
        EMPTY_SUBMITS.fetch_add(1, Ordering::Relaxed);
    }
    let real: vk::PFN_vkQueueSubmit =
        unsafe { std::mem::transmute(REAL_SUBMIT.load(Ordering::Relaxed)) };
    unsafe { real(queue, count, submits, fence) }
}

unsafe extern "system" fn wait_semaphores(
    device: vk::Device,
    info: *const vk::SemaphoreWaitInfo<'_>,
    timeout: u64,
) -> vk::Result {
    let real: vk::PFN_vkWaitSemaphores =
        unsafe { std::mem::transmute(REAL_WAIT_SEMAPHORES.load(Ordering::Relaxed)) };
    count_wait(unsafe { real(device, info, timeout) })
}

unsafe extern "system" fn wait_for_fences(
    device: vk::Device,
    count: u32,
    fences: *const vk::Fence,
    wait_all: vk::Bool32,
    timeout: u64,
) -> vk::Result {
    let real: vk::PFN_vkWaitForFences =
        unsafe { std::mem::transmute(REAL_WAIT_FENCES.load(Ordering::Relaxed)) };
    count_wait(unsafe { real(device, count, fences, wait_all, timeout) })
}

/// Counts a waiting call that ended the wait. A host wait polls for Ctrl-C: it calls again
/// after each `TIMEOUT` of its poll interval, so on a busy machine one wait is several calls,
/// of which only the last returns something else.
fn count_wait(r: vk::Result) -> vk::Result {
    if r != vk::Result::TIMEOUT {
        WAITS.fetch_add(1, Ordering::Relaxed);
    }
    r
}

fn hook(name: &CStr, real: *const c_void) -> *const c_void {
    if real.is_null() {
        return real;
    }
    let (slot, ours): (&AtomicUsize, *const c_void) = match name.to_bytes() {
        b"vkQueueSubmit" => (&REAL_SUBMIT, queue_submit as *const c_void),
        b"vkWaitSemaphores" => (&REAL_WAIT_SEMAPHORES, wait_semaphores as *const c_void),
        b"vkWaitForFences" => (&REAL_WAIT_FENCES, wait_for_fences as *const c_void),
        _ => return real,
    };
    slot.store(real as usize, Ordering::Relaxed);
    ours
}

#[test]
fn counters_agree_with_wrapped_entry_points() {
    for (legacy, no_rebar, force) in [
        (false, false, false),
        (false, true, false),
        (false, false, true),
        (true, false, false),
        (true, true, false),
    ] {
        let cfg = VkConfig {
            legacy_submits: legacy,
            no_host_visible_vram: no_rebar,
            force_transfer_submit: force,
            compute_stream_copy_max: Some(64),
            entry_point_hook: Some(hook),
            ..common::config()
        };
        let Some(b) = common::open(cfg) else { return };
        let cpu = CpuBackend::new();
        let host = cpu.alloc_buffer(1024, BufferUsage::Compute).unwrap();
        let inp = b.alloc_buffer(256, BufferUsage::Inputs).unwrap();
        let w = b.alloc_buffer(256, BufferUsage::Weights).unwrap();
        let out = b.alloc_buffer(256, BufferUsage::Compute).unwrap();
        let g = common::add_graph(inp, w, out, 64);
        let (s0, e0, w0) = (
            SUBMITS.load(Ordering::Relaxed),
            EMPTY_SUBMITS.load(Ordering::Relaxed),
            WAITS.load(Ordering::Relaxed),
        );
        let before = b.stats().snapshot();
        let mut buf = [0u8; 256];
        for step in 0..300u32 {
            match step * 7919 % 7 {
                0 => b
                    .set_tensor_async_staged(inp, 0, &[step as u8; 256])
                    .unwrap(),
                1 => b.graph_compute_async(&g).unwrap(),
                2 => b.synchronize().unwrap(),
                3 => b.get_tensor(out, 0, &mut buf).unwrap(),
                4 => b.set_tensor(w, 0, &[1u8; 256]).unwrap(),
                5 => {
                    let n = if step % 2 == 0 { 32 } else { 256 };
                    assert!(b.cpy_tensor_async(&cpu, host, 0, inp, 0, n).unwrap());
                }
                _ => {
                    let ev = b.event_new().unwrap();
                    b.event_record(&ev).unwrap();
                    ev.synchronize().unwrap();
                }
            }
        }
        b.synchronize().unwrap();
        let d = b.stats().snapshot().since(&before);
        let got = (
            SUBMITS.load(Ordering::Relaxed) - s0,
            EMPTY_SUBMITS.load(Ordering::Relaxed) - e0,
            WAITS.load(Ordering::Relaxed) - w0,
        );
        assert_eq!(
            (d.submits, d.empty_submits, d.driver_syncs),
            got,
            "legacy={legacy} no_rebar={no_rebar} force_transfer={force}"
        );
        assert_eq!(d.host_waits, d.driver_syncs);
        // The legacy switch's empty submissions, exactly: ggml's one per `synchronize` (the
        // 2s of the sequence and the final one, outstanding work or not), and one per blocking
        // read that drains outstanding work before reading mapped memory (each read follows a
        // graph); a read through the readback arena carries its copy instead. Nothing else
        // submits an empty batch, and without the switch nothing does (invariant 7).
        let of_kind = |k: u32| (0..300u32).filter(|s| s * 7919 % 7 == k).count() as u64;
        let mapped_reads = if b.is_host_readable(out) {
            of_kind(3)
        } else {
            0
        };
        let want_empty = if legacy {
            of_kind(2) + 1 + mapped_reads
        } else {
            0
        };
        assert_eq!(
            d.empty_submits, want_empty,
            "legacy={legacy} no_rebar={no_rebar} force_transfer={force}"
        );
        common::assert_clean(&b);
    }
}
