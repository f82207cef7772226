//! Device buffers and the staging / readback / scratch arenas.
//!
//! Why: tensors live in `VkBuffer`s placed by gpu-allocator; host bytes reach unmapped memory
//! only through host-visible staging, and results come back through host-cached readback
//! memory. Staging must be reusable across steps without ever being rewritten while a queued
//! copy still reads it (invariant 8), and must stay bounded however many steps run.
//!
//! Strategy: a [`DevBuffer`] records whether the host may write it directly (mapped, coherent,
//! and not on the forced no-ReBAR path) and read it directly (also host-cached). An [`Arena`]
//! is a list of persistently mapped chunks, each bump-allocated and stamped with the
//! `Retire` point (compute and transfer timeline values) of the last submission that uses
//! it; a chunk is reset once both values completed. An arena grows by a chunk when no chunk
//! fits, up to a cap; past the cap the caller must wait for the device and retry. Chunks that
//! stay unused for many reclaims are freed, so a one-off large upload does not pin memory.
//!
//! Invariants: a region is handed out only from a chunk whose previous users all completed;
//! `staging_bytes_in_use` is exactly the bytes of staging regions not yet reclaimed.

use std::ptr::NonNull;

use ash::vk;
use gpu_allocator::vulkan::{Allocation, AllocationCreateDesc, AllocationScheme, Allocator};
use gpu_allocator::MemoryLocation;
use lowsync_backend::{BufferUsage, Result};

use crate::device::{unavailable, vk_err};
use crate::timeline::Retire;

/// Round `v` up to a multiple of `a` (a power of two).
pub(crate) fn align_up(v: u64, a: u64) -> u64 {
    (v + a - 1) & !(a - 1)
}

/// Buffers at or above this size get their own `VkDeviceMemory` (weights, KV cache).
const DEDICATED_MIN_BYTES: u64 = 32 << 20;

/// A `VkBuffer` with its memory.
pub(crate) struct DevBuffer {
    pub buffer: vk::Buffer,
    pub alloc: Option<Allocation>,
    /// The size the caller asked for.
    pub size: u64,
    /// The size of the `VkBuffer` (rounded up; at least 16 bytes).
    pub vk_size: u64,
    /// Host address for direct writes, when the host may write this buffer directly.
    pub write_ptr: Option<NonNull<u8>>,
    /// The host may also read directly (the memory is host-cached).
    pub host_read: bool,
    /// What the buffer holds (kept for re-allocation).
    pub usage: BufferUsage,
}

// SAFETY: the mapped pointer refers to device memory owned by this buffer; every access goes
// through the backend's state lock.
unsafe impl Send for DevBuffer {}

/// How a device buffer is placed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Placement {
    pub location: MemoryLocation,
    /// Whether the host may access the buffer directly when its memory is mapped.
    pub host_access: bool,
}

pub(crate) fn create_buffer(
    device: &ash::Device,
    allocator: &mut Allocator,
    size: u64,
    placement: Placement,
    concurrent_families: &[u32],
    name: &str,
) -> Result<DevBuffer> {
    let vk_size = align_up(size.max(16), 16);
    let mut info = vk::BufferCreateInfo::default()
        .size(vk_size)
        .usage(
            vk::BufferUsageFlags::STORAGE_BUFFER
                | vk::BufferUsageFlags::TRANSFER_SRC
                | vk::BufferUsageFlags::TRANSFER_DST,
        )
        .sharing_mode(vk::SharingMode::EXCLUSIVE);
    if concurrent_families.len() > 1 {
        info = info
            .sharing_mode(vk::SharingMode::CONCURRENT)
            .queue_family_indices(concurrent_families);
    }
    // SAFETY: valid create info on a live device.
    let buffer =
        unsafe { device.create_buffer(&info, None) }.map_err(|r| vk_err("vkCreateBuffer", r))?;
    // SAFETY: `buffer` was just created on this device.
    let requirements = unsafe { device.get_buffer_memory_requirements(buffer) };
    let scheme = if vk_size >= DEDICATED_MIN_BYTES {
        AllocationScheme::DedicatedBuffer(buffer)
    } else {
        AllocationScheme::GpuAllocatorManaged
    };
    let alloc = allocator.allocate(&AllocationCreateDesc {
        name,
        requirements,
        location: placement.location,
        linear: true,
        allocation_scheme: scheme,
    });
    let alloc = match alloc {
        Ok(a) => a,
        Err(e) => {
            // SAFETY: the buffer is unused and has no memory bound.
            unsafe { device.destroy_buffer(buffer, None) };
            return Err(unavailable(format!(
                "cannot allocate {size} bytes of Vulkan memory ({name}): {e}"
            )));
        }
    };
    // SAFETY: memory and offset come from an allocation made for this buffer's requirements.
    if let Err(r) = unsafe { device.bind_buffer_memory(buffer, alloc.memory(), alloc.offset()) } {
        let _ = allocator.free(alloc);
        // SAFETY: as above.
        unsafe { device.destroy_buffer(buffer, None) };
        return Err(vk_err("vkBindBufferMemory", r));
    }
    let flags = alloc.memory_properties();
    let coherent = flags.contains(vk::MemoryPropertyFlags::HOST_COHERENT);
    let ptr = alloc
        .mapped_ptr()
        .filter(|_| placement.host_access && coherent)
        .map(|p| p.cast::<u8>());
    let host_read = ptr.is_some() && flags.contains(vk::MemoryPropertyFlags::HOST_CACHED);
    Ok(DevBuffer {
        buffer,
        alloc: Some(alloc),
        size,
        vk_size,
        write_ptr: ptr,
        host_read,
        usage: BufferUsage::Compute,
    })
}

pub(crate) fn destroy_buffer(device: &ash::Device, allocator: &mut Allocator, mut b: DevBuffer) {
    if let Some(a) = b.alloc.take() {
        let _ = allocator.free(a);
    }
    // SAFETY: callers destroy a buffer only after every submission using it completed.
    unsafe { device.destroy_buffer(b.buffer, None) };
}

/// A region handed out by an [`Arena`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub buffer: vk::Buffer,
    pub offset: u64,
    /// Host address of the region (null for device-only arenas).
    pub ptr: *mut u8,
}

struct Chunk {
    buf: DevBuffer,
    ptr: *mut u8,
    used: u64,
    /// Bytes of live regions (without alignment padding).
    live: u64,
    retire: Retire,
    /// Reclaims since this chunk last held a region.
    idle: u32,
}

/// A chunked, timeline-reclaimed bump allocator over buffers of one placement.
pub(crate) struct Arena {
    name: &'static str,
    placement: Placement,
    chunks: Vec<Chunk>,
    min_chunk: u64,
    cap_bytes: u64,
    /// Queue families that use the arena's buffers.
    families: Vec<u32>,
    /// Bytes handed out and not yet reclaimed.
    pub live_bytes: u64,
    /// Chunks destroyed since the last [`Arena::take_destroyed`] (their descriptor sets must
    /// be forgotten before a new buffer can reuse the handle).
    destroyed: Vec<vk::Buffer>,
}

// SAFETY: chunk pointers refer to mapped memory owned by the arena; access is under the
// backend's state lock.
unsafe impl Send for Arena {}

/// Chunks unused for this many reclaims are freed (when other chunks remain).
const IDLE_FREE_AFTER: u32 = 64;

impl Arena {
    pub(crate) fn new(
        name: &'static str,
        placement: Placement,
        min_chunk: u64,
        cap_bytes: u64,
        families: Vec<u32>,
    ) -> Self {
        Arena {
            name,
            placement,
            chunks: Vec::new(),
            min_chunk,
            cap_bytes,
            families,
            live_bytes: 0,
            destroyed: Vec::new(),
        }
    }

    /// Total bytes of the arena's chunks.
    pub(crate) fn capacity(&self) -> u64 {
        self.chunks.iter().map(|c| c.buf.vk_size).sum()
    }

    /// The largest single region this arena can hand out.
    pub(crate) fn max_region(&self) -> u64 {
        self.cap_bytes / 2
    }

    /// Resets every chunk whose users completed by `done`; returns the bytes released.
    pub(crate) fn reclaim(
        &mut self,
        done: Retire,
        device: &ash::Device,
        allocator: &mut Allocator,
    ) -> u64 {
        let mut freed = 0;
        for c in &mut self.chunks {
            if c.used > 0 && c.retire.done_by(done) {
                freed += c.live;
                c.used = 0;
                c.live = 0;
                c.idle = 0;
            } else if c.used == 0 {
                c.idle = c.idle.saturating_add(1);
            }
        }
        self.live_bytes -= freed;
        // Free one long-idle chunk per reclaim, never the largest.
        let largest = (0..self.chunks.len()).max_by_key(|&i| self.chunks[i].buf.vk_size);
        let idle = (0..self.chunks.len()).find(|&i| {
            Some(i) != largest && self.chunks[i].used == 0 && self.chunks[i].idle >= IDLE_FREE_AFTER
        });
        if let Some(i) = idle {
            let c = self.chunks.swap_remove(i);
            self.destroyed.push(c.buf.buffer);
            destroy_buffer(device, allocator, c.buf);
        }
        freed
    }

    /// A region of `len` bytes aligned to `align`, used by submissions up to `retire`.
    /// `Ok(None)`: the arena is at its cap and nothing is reclaimable — wait, reclaim, retry.
    pub(crate) fn alloc(
        &mut self,
        len: u64,
        align: u64,
        retire: Retire,
        device: &ash::Device,
        allocator: &mut Allocator,
    ) -> Result<Option<Region>> {
        let len = len.max(1);
        let fits = |c: &Chunk| align_up(c.used, align) + len <= c.buf.vk_size;
        // Prefer a chunk already in use by this submission window (keeps regions together),
        // then any empty chunk that fits.
        let pick = self
            .chunks
            .iter()
            .position(|c| c.used > 0 && fits(c))
            .or_else(|| self.chunks.iter().position(|c| c.used == 0 && fits(c)));
        let i = match pick {
            Some(i) => i,
            None => {
                let size = len.next_power_of_two().max(self.min_chunk);
                if self.capacity() + size > self.cap_bytes {
                    // Make room by dropping empty chunks that are too small.
                    let mut j = 0;
                    while j < self.chunks.len() {
                        if self.chunks[j].used == 0 {
                            let c = self.chunks.swap_remove(j);
                            self.destroyed.push(c.buf.buffer);
                            destroy_buffer(device, allocator, c.buf);
                        } else {
                            j += 1;
                        }
                    }
                    if self.capacity() + size > self.cap_bytes && !self.chunks.is_empty() {
                        return Ok(None);
                    }
                }
                let buf = create_buffer(
                    device,
                    allocator,
                    size,
                    self.placement,
                    &self.families,
                    self.name,
                )?;
                let ptr = buf
                    .alloc
                    .as_ref()
                    .and_then(|a| a.mapped_ptr())
                    .map_or(std::ptr::null_mut(), |p| p.as_ptr().cast::<u8>());
                if self.placement.host_access && ptr.is_null() {
                    destroy_buffer(device, allocator, buf);
                    return Err(unavailable(format!(
                        "the {} arena needs host-visible memory and got none",
                        self.name
                    )));
                }
                self.chunks.push(Chunk {
                    buf,
                    ptr,
                    used: 0,
                    live: 0,
                    retire: Retire::default(),
                    idle: 0,
                });
                tracing::debug!(
                    arena = self.name,
                    size,
                    total = self.capacity(),
                    "arena grew"
                );
                self.chunks.len() - 1
            }
        };
        let c = &mut self.chunks[i];
        let offset = align_up(c.used, align);
        c.used = offset + len;
        c.live += len;
        c.retire = c.retire.max(retire);
        self.live_bytes += len;
        let ptr = if c.ptr.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: `offset + len` lies inside the chunk's mapping.
            unsafe { c.ptr.add(offset as usize) }
        };
        Ok(Some(Region {
            buffer: c.buf.buffer,
            offset,
            ptr,
        }))
    }

    /// Buffers of chunks destroyed since the last call.
    pub(crate) fn take_destroyed(&mut self) -> Vec<vk::Buffer> {
        std::mem::take(&mut self.destroyed)
    }

    pub(crate) fn destroy(&mut self, device: &ash::Device, allocator: &mut Allocator) {
        for c in self.chunks.drain(..) {
            destroy_buffer(device, allocator, c.buf);
        }
        self.live_bytes = 0;
    }
}
