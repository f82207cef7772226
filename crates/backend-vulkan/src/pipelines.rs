//! Compute pipelines (created once per kernel variant and cached), the push-constant block they
//! share, and descriptor sets (cached by their bindings and reused across steps).
//!
//! Why: a decode step records the same few hundred dispatches every token. Creating a
//! pipeline or writing a descriptor set per dispatch would cost more host time than the
//! kernels; with a graph reused across steps the bindings repeat exactly, so a set written
//! once serves every later step.
//!
//! Strategy: SPIR-V for every variant is embedded at build time (`build.rs`); a variant's
//! pipeline is created on first use. Kernels with `n` storage bindings share one descriptor
//! set layout and one pipeline layout (plus 128 bytes of push constants). A descriptor set is
//! keyed by its `(buffer, offset, range)` bindings; sets are freed when one of their buffers is
//! destroyed (after its last submission completed), or all at once past a cache size while
//! the stream is idle.
//!
//! Invariant: a descriptor set is never updated or freed while a pending submission may use it
//! (sets are immutable once written; frees wait for their retire point).

use std::collections::HashMap;
use std::sync::OnceLock;

use ash::vk;
use bytemuck::{Pod, Zeroable};
use lowsync_backend::Result;

use crate::device::{unavailable, vk_err};

mod shaders {
    include!(concat!(env!("OUT_DIR"), "/shaders.rs"));
}

/// Bytes of push constants every kernel may read.
pub(crate) const PUSH_BYTES: u32 = 128;
/// The most storage bindings a kernel has.
pub(crate) const MAX_BINDINGS: usize = 6;
/// Descriptor sets kept before completed ones are evicted.
const SET_CACHE_MAX: usize = 8192;
const SETS_PER_POOL: u32 = 512;

fn spirv(name: &str) -> Option<&'static [u8]> {
    static TABLE: OnceLock<HashMap<&'static str, &'static [u8]>> = OnceLock::new();
    TABLE
        .get_or_init(|| shaders::SPIRV.iter().copied().collect())
        .get(name)
        .copied()
}

/// Push constants: eight `uvec4`s (128 bytes, the guaranteed minimum), named as the kernels
/// name them; each kernel's header says what its fields hold.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub(crate) struct Push {
    pub shape: [u32; 4],
    pub d_str: [u32; 4],
    pub a_str: [u32; 4],
    pub b_str: [u32; 4],
    pub offs: [u32; 4],
    pub op: [u32; 4],
    pub prm: [u32; 4],
    pub pad: [u32; 4],
}

// Every pipeline layout declares exactly this many push-constant bytes.
const _: () = assert!(std::mem::size_of::<Push>() == PUSH_BYTES as usize);

/// One storage-buffer binding of a dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Bind {
    pub buffer: vk::Buffer,
    pub offset: u64,
    pub range: u64,
    pub write: bool,
}

struct SetEntry {
    set: vk::DescriptorSet,
    pool: usize,
}

pub(crate) struct Pipelines {
    set_layouts: Vec<vk::DescriptorSetLayout>,
    layouts: Vec<vk::PipelineLayout>,
    pipelines: HashMap<String, vk::Pipeline>,
    pools: Vec<vk::DescriptorPool>,
    sets: HashMap<Vec<(vk::Buffer, u64, u64)>, SetEntry>,
}

impl Pipelines {
    pub(crate) fn new(device: &ash::Device) -> Result<Self> {
        let mut p = Pipelines {
            set_layouts: Vec::new(),
            layouts: Vec::new(),
            pipelines: HashMap::new(),
            pools: Vec::new(),
            sets: HashMap::new(),
        };
        let push = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .offset(0)
            .size(PUSH_BYTES)];
        for n in 0..=MAX_BINDINGS {
            let bindings: Vec<_> = (0..n as u32)
                .map(|i| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(i)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let info = vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings);
            // SAFETY: valid create info on a live device.
            let sl = unsafe { device.create_descriptor_set_layout(&info, None) };
            let sl = match sl {
                Ok(sl) => sl,
                Err(r) => {
                    p.destroy(device);
                    return Err(vk_err("vkCreateDescriptorSetLayout", r));
                }
            };
            p.set_layouts.push(sl);
            let sls = [sl];
            let info = vk::PipelineLayoutCreateInfo::default()
                .set_layouts(&sls)
                .push_constant_ranges(&push);
            // SAFETY: as above.
            match unsafe { device.create_pipeline_layout(&info, None) } {
                Ok(l) => p.layouts.push(l),
                Err(r) => {
                    p.destroy(device);
                    return Err(vk_err("vkCreatePipelineLayout", r));
                }
            }
        }
        Ok(p)
    }

    /// The pipeline of kernel variant `name` with `n` bindings, and its layout.
    pub(crate) fn pipeline(
        &mut self,
        device: &ash::Device,
        name: &str,
        n: usize,
    ) -> Result<(vk::Pipeline, vk::PipelineLayout)> {
        let layout = *self
            .layouts
            .get(n)
            .ok_or_else(|| unavailable(format!("kernel {name} has {n} bindings")))?;
        if let Some(&p) = self.pipelines.get(name) {
            return Ok((p, layout));
        }
        let bytes = spirv(name)
            .ok_or_else(|| unavailable(format!("no compiled shader variant `{name}`")))?;
        let words = ash::util::read_spv(&mut std::io::Cursor::new(bytes))
            .map_err(|e| unavailable(format!("shader `{name}` is not SPIR-V: {e}")))?;
        let info = vk::ShaderModuleCreateInfo::default().code(&words);
        // SAFETY: `words` is SPIR-V validated by naga at build time.
        let module = unsafe { device.create_shader_module(&info, None) }
            .map_err(|r| vk_err("vkCreateShaderModule", r))?;
        let stage = vk::PipelineShaderStageCreateInfo::default()
            .stage(vk::ShaderStageFlags::COMPUTE)
            .module(module)
            .name(c"main");
        let info = vk::ComputePipelineCreateInfo::default()
            .stage(stage)
            .layout(layout);
        // SAFETY: module and layout are live; the module is destroyed after creation.
        let created =
            unsafe { device.create_compute_pipelines(vk::PipelineCache::null(), &[info], None) };
        // SAFETY: the module is no longer needed once the pipeline exists (or failed).
        unsafe { device.destroy_shader_module(module, None) };
        let pipeline = match created {
            Ok(v) => v.into_iter().next(),
            Err((_, r)) => return Err(vk_err("vkCreateComputePipelines", r)),
        }
        .ok_or_else(|| unavailable("vkCreateComputePipelines returned no pipeline"))?;
        tracing::debug!(kernel = name, "pipeline created");
        self.pipelines.insert(name.to_string(), pipeline);
        Ok((pipeline, layout))
    }

    /// A descriptor set binding `binds` in order (cached: written once, reused).
    pub(crate) fn descriptor_set(
        &mut self,
        device: &ash::Device,
        binds: &[Bind],
    ) -> Result<vk::DescriptorSet> {
        let key: Vec<_> = binds
            .iter()
            .map(|b| (b.buffer, b.offset, b.range))
            .collect();
        if let Some(e) = self.sets.get(&key) {
            return Ok(e.set);
        }
        let layout = *self
            .set_layouts
            .get(binds.len())
            .ok_or_else(|| unavailable(format!("{} bindings", binds.len())))?;
        let (set, pool) = self.allocate_set(device, layout)?;
        let infos: Vec<_> = binds
            .iter()
            .map(|b| {
                vk::DescriptorBufferInfo::default()
                    .buffer(b.buffer)
                    .offset(b.offset)
                    .range(b.range)
            })
            .collect();
        let writes: Vec<_> = infos
            .iter()
            .enumerate()
            .map(|(i, info)| {
                vk::WriteDescriptorSet::default()
                    .dst_set(set)
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(std::slice::from_ref(info))
            })
            .collect();
        // SAFETY: a freshly allocated set that no submission uses yet.
        unsafe { device.update_descriptor_sets(&writes, &[]) };
        self.sets.insert(key, SetEntry { set, pool });
        Ok(set)
    }

    fn allocate_set(
        &mut self,
        device: &ash::Device,
        layout: vk::DescriptorSetLayout,
    ) -> Result<(vk::DescriptorSet, usize)> {
        let layouts = [layout];
        if let Some(&pool) = self.pools.last() {
            let info = vk::DescriptorSetAllocateInfo::default()
                .descriptor_pool(pool)
                .set_layouts(&layouts);
            // SAFETY: a live pool and layout.
            match unsafe { device.allocate_descriptor_sets(&info) } {
                Ok(v) if !v.is_empty() => return Ok((v[0], self.pools.len() - 1)),
                Ok(_)
                | Err(vk::Result::ERROR_OUT_OF_POOL_MEMORY)
                | Err(vk::Result::ERROR_FRAGMENTED_POOL) => {}
                Err(r) => return Err(vk_err("vkAllocateDescriptorSets", r)),
            }
        }
        let sizes = [vk::DescriptorPoolSize {
            ty: vk::DescriptorType::STORAGE_BUFFER,
            descriptor_count: SETS_PER_POOL * MAX_BINDINGS as u32,
        }];
        let info = vk::DescriptorPoolCreateInfo::default()
            .flags(vk::DescriptorPoolCreateFlags::FREE_DESCRIPTOR_SET)
            .max_sets(SETS_PER_POOL)
            .pool_sizes(&sizes);
        // SAFETY: valid create info.
        let pool = unsafe { device.create_descriptor_pool(&info, None) }
            .map_err(|r| vk_err("vkCreateDescriptorPool", r))?;
        self.pools.push(pool);
        let info = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(pool)
            .set_layouts(&layouts);
        // SAFETY: a fresh pool with room.
        let v = unsafe { device.allocate_descriptor_sets(&info) }
            .map_err(|r| vk_err("vkAllocateDescriptorSets", r))?;
        let set = v
            .into_iter()
            .next()
            .ok_or_else(|| unavailable("vkAllocateDescriptorSets returned no set"))?;
        Ok((set, self.pools.len() - 1))
    }

    fn free(&mut self, device: &ash::Device, e: SetEntry) {
        if let Some(&pool) = self.pools.get(e.pool) {
            // SAFETY: the set's last submission completed (callers guarantee it).
            let _ = unsafe { device.free_descriptor_sets(pool, &[e.set]) };
        }
    }

    /// Frees the sets that bind `buffer` (which is about to be destroyed; its users completed).
    pub(crate) fn forget_buffer(&mut self, device: &ash::Device, buffer: vk::Buffer) {
        let keys: Vec<_> = self
            .sets
            .keys()
            .filter(|k| k.iter().any(|b| b.0 == buffer))
            .cloned()
            .collect();
        for k in keys {
            if let Some(e) = self.sets.remove(&k) {
                self.free(device, e);
            }
        }
    }

    /// Past the cache size, frees every cached set; returns whether it did. Call only when no
    /// submission is pending.
    pub(crate) fn evict(&mut self, device: &ash::Device) -> bool {
        if self.sets.len() <= SET_CACHE_MAX {
            return false;
        }
        let all: Vec<_> = self.sets.drain().map(|(_, e)| e).collect();
        for e in all {
            self.free(device, e);
        }
        true
    }

    /// Number of cached descriptor sets (for tests of reuse).
    pub(crate) fn cached_sets(&self) -> usize {
        self.sets.len()
    }

    pub(crate) fn destroy(&mut self, device: &ash::Device) {
        // SAFETY: called once the device is idle.
        unsafe {
            for (_, p) in self.pipelines.drain() {
                device.destroy_pipeline(p, None);
            }
            self.sets.clear();
            for p in self.pools.drain(..) {
                device.destroy_descriptor_pool(p, None);
            }
            for l in self.layouts.drain(..) {
                device.destroy_pipeline_layout(l, None);
            }
            for l in self.set_layouts.drain(..) {
                device.destroy_descriptor_set_layout(l, None);
            }
        }
    }
}
