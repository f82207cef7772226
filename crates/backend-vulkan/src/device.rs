//! Instance, physical device and queue selection, the validation-message sink, and the
//! command-pool helpers every queue route uses.
//!
//! Why: everything else needs one logical device with a compute queue, an optional dedicated
//! transfer queue, timeline semaphores, and — in tests — the Khronos validation layer with
//! synchronization validation, whose findings must be readable (and countable as failures).
//!
//! Strategy: the loader is opened at run time (`ash::Entry::load`), so a machine without Vulkan
//! gets `Error::Unavailable`, never a panic or a link error. It is opened once per process with
//! a bare instance that is never destroyed: destroying a process's last instance unloads the
//! driver, and NVIDIA's, loaded again for each context, ran out of static TLS after about 30
//! (`libnvidia-tls.so: cannot allocate memory in static TLS block`; the loader then found no
//! driver). The compute queue comes from a family with COMPUTE (one without GRAPHICS
//! preferred); the transfer queue from a family with TRANSFER and neither COMPUTE nor GRAPHICS,
//! when the device has one (lavapipe has not).
//! Validation messages of severity warning and above are appended to a list the owner can read.
//!
//! Invariants: devices below Vulkan 1.2 or without `timelineSemaphore` are refused with a
//! reason; the debug messenger outlives every object of its instance (destroyed last).

use std::ffi::{c_void, CStr};
use std::sync::{Arc, OnceLock};

use ash::vk;
use lowsync_backend::{Error, Result};
use parking_lot::Mutex;

use crate::config::VkConfig;

const VALIDATION_LAYER: &CStr = c"VK_LAYER_KHRONOS_validation";

/// Warnings and errors reported by the validation layer, in arrival order.
pub(crate) type MessageSink = Arc<Mutex<Vec<String>>>;

pub(crate) fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: "Vulkan".into(),
        reason: reason.into(),
    }
}

/// A Vulkan call failed: the message names the call.
pub(crate) fn vk_err(what: &str, r: vk::Result) -> Error {
    unavailable(format!("{what} failed: {r:?}"))
}

/// A command pool of `family` whose buffers are reset one by one (each route recycles its
/// buffers as their submissions complete).
pub(crate) fn create_pool(device: &ash::Device, family: u32) -> Result<vk::CommandPool> {
    let info = vk::CommandPoolCreateInfo::default()
        .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER)
        .queue_family_index(family);
    // SAFETY: valid create info.
    unsafe { device.create_command_pool(&info, None) }.map_err(|r| vk_err("vkCreateCommandPool", r))
}

/// One command buffer of `level` from `pool`; the caller serialises use of the pool.
pub(crate) fn allocate_command_buffer(
    device: &ash::Device,
    pool: vk::CommandPool,
    level: vk::CommandBufferLevel,
) -> Result<vk::CommandBuffer> {
    let info = vk::CommandBufferAllocateInfo::default()
        .command_pool(pool)
        .level(level)
        .command_buffer_count(1);
    // SAFETY: a live pool, used by one thread at a time (the owner's lock).
    let v = unsafe { device.allocate_command_buffers(&info) }
        .map_err(|r| vk_err("vkAllocateCommandBuffers", r))?;
    v.into_iter()
        .next()
        .ok_or_else(|| unavailable("no command buffer allocated"))
}

unsafe extern "system" fn on_message(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    types: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user: *mut c_void,
) -> vk::Bool32 {
    // SAFETY: the layer passes valid callback data for the duration of the call; `user` is
    // the `Mutex<Vec<String>>` kept alive by the owning `Instance` until the messenger is gone.
    let msg = unsafe {
        if data.is_null() || (*data).p_message.is_null() {
            String::new()
        } else {
            CStr::from_ptr((*data).p_message)
                .to_string_lossy()
                .into_owned()
        }
    };
    tracing::warn!(target: "lowsync_vulkan::validation", ?severity, ?types, "{msg}");
    if !user.is_null() {
        // SAFETY: see above.
        let sink = unsafe { &*(user as *const Mutex<Vec<String>>) };
        sink.lock().push(format!("{severity:?} {types:?}: {msg}"));
    }
    vk::FALSE
}

/// The process's Vulkan loader, opened on first use and kept, with a bare instance that keeps
/// the driver loaded (see the module's strategy; without a driver the instance is not made and
/// the context's own instance reports why).
fn entry() -> Result<&'static ash::Entry> {
    static ENTRY: OnceLock<std::result::Result<(ash::Entry, Option<vk::Instance>), String>> =
        OnceLock::new();
    ENTRY
        .get_or_init(|| {
            // SAFETY: loading the system loader library; failure is reported, not fatal.
            let entry = unsafe { ash::Entry::load() }
                .map_err(|e| format!("no Vulkan loader (libvulkan.so.1): {e}"))?;
            let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_2);
            let info = vk::InstanceCreateInfo::default().application_info(&app);
            // SAFETY: a plain instance on a loaded entry; it is never destroyed, on purpose.
            let anchor = unsafe { entry.create_instance(&info, None) }
                .ok()
                .map(|i| i.handle());
            Ok((entry, anchor))
        })
        .as_ref()
        .map(|(entry, _)| entry)
        .map_err(|e| unavailable(e.clone()))
}

/// An instance, with the validation layer and its messenger when asked for.
pub(crate) struct Instance {
    pub instance: ash::Instance,
    debug: Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
    pub messages: MessageSink,
}

impl Instance {
    pub(crate) fn new(validation: bool) -> Result<Self> {
        let entry = entry()?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"lowsync")
            .api_version(vk::API_VERSION_1_3);
        let mut layers: Vec<*const std::ffi::c_char> = Vec::new();
        let mut exts: Vec<*const std::ffi::c_char> = Vec::new();
        let enables = [vk::ValidationFeatureEnableEXT::SYNCHRONIZATION_VALIDATION];
        let mut features =
            vk::ValidationFeaturesEXT::default().enabled_validation_features(&enables);
        if validation {
            // SAFETY: plain enumeration on a loaded entry.
            let have = unsafe { entry.enumerate_instance_layer_properties() }
                .map_err(|r| vk_err("vkEnumerateInstanceLayerProperties", r))?;
            let found = have
                .iter()
                .any(|l| l.layer_name_as_c_str().ok() == Some(VALIDATION_LAYER));
            if !found {
                return Err(unavailable(
                    "LOWSYNC_VK_VALIDATION=1 but VK_LAYER_KHRONOS_validation is not installed \
                     (apt-get install vulkan-validationlayers)",
                ));
            }
            layers.push(VALIDATION_LAYER.as_ptr());
            exts.push(ash::ext::debug_utils::NAME.as_ptr());
            exts.push(ash::ext::validation_features::NAME.as_ptr());
        }
        let mut info = vk::InstanceCreateInfo::default()
            .application_info(&app)
            .enabled_layer_names(&layers)
            .enabled_extension_names(&exts);
        if validation {
            info = info.push_next(&mut features);
        }
        // SAFETY: every pointer in `info` outlives the call.
        let instance = unsafe { entry.create_instance(&info, None) }.map_err(|r| match r {
            vk::Result::ERROR_INCOMPATIBLE_DRIVER => unavailable(
                "the Vulkan loader found no driver (install mesa-vulkan-drivers for lavapipe, \
                 or point VK_DRIVER_FILES at a GPU driver's ICD json)",
            ),
            r => vk_err("vkCreateInstance", r),
        })?;
        let messages: MessageSink = Arc::new(Mutex::new(Vec::new()));
        let debug = if validation {
            let du = ash::ext::debug_utils::Instance::new(entry, &instance);
            let info = vk::DebugUtilsMessengerCreateInfoEXT::default()
                .message_severity(
                    vk::DebugUtilsMessageSeverityFlagsEXT::WARNING
                        | vk::DebugUtilsMessageSeverityFlagsEXT::ERROR,
                )
                .message_type(
                    vk::DebugUtilsMessageTypeFlagsEXT::VALIDATION
                        | vk::DebugUtilsMessageTypeFlagsEXT::PERFORMANCE,
                )
                .pfn_user_callback(Some(on_message))
                .user_data(Arc::as_ptr(&messages) as *mut c_void);
            // SAFETY: the sink outlives the messenger (dropped after it in `Drop`).
            match unsafe { du.create_debug_utils_messenger(&info, None) } {
                Ok(m) => Some((du, m)),
                Err(r) => {
                    // SAFETY: nothing else was created from the instance yet.
                    unsafe { instance.destroy_instance(None) };
                    return Err(vk_err("vkCreateDebugUtilsMessengerEXT", r));
                }
            }
        } else {
            None
        };
        Ok(Instance {
            instance,
            debug,
            messages,
        })
    }

    /// Physical devices lowsync can run on, with the reason for each one it cannot.
    pub(crate) fn devices(
        &self,
    ) -> Result<Vec<(vk::PhysicalDevice, std::result::Result<(), String>)>> {
        // SAFETY: plain enumeration on a live instance.
        let pds = unsafe { self.instance.enumerate_physical_devices() }
            .map_err(|r| vk_err("vkEnumeratePhysicalDevices", r))?;
        Ok(pds.into_iter().map(|pd| (pd, self.usable(pd))).collect())
    }

    /// The reported kind of physical device `index` (see [`crate::device_type`]).
    pub(crate) fn device_type(&self, index: usize) -> Result<&'static str> {
        let devices = self.devices()?;
        let Some(&(pd, _)) = devices.get(index) else {
            return Err(unavailable(format!(
                "no Vulkan device {index} ({} found)",
                devices.len()
            )));
        };
        // SAFETY: a query on a physical device of this instance.
        let props = unsafe { self.instance.get_physical_device_properties(pd) };
        Ok(match props.device_type {
            vk::PhysicalDeviceType::CPU => "cpu",
            vk::PhysicalDeviceType::DISCRETE_GPU => "discrete_gpu",
            vk::PhysicalDeviceType::INTEGRATED_GPU => "integrated_gpu",
            vk::PhysicalDeviceType::VIRTUAL_GPU => "virtual_gpu",
            _ => "other",
        })
    }

    fn usable(&self, pd: vk::PhysicalDevice) -> std::result::Result<(), String> {
        // SAFETY: queries on a physical device of this instance.
        let props = unsafe { self.instance.get_physical_device_properties(pd) };
        if props.api_version < vk::API_VERSION_1_2 {
            return Err(format!(
                "device supports Vulkan {}.{}, lowsync needs 1.2",
                vk::api_version_major(props.api_version),
                vk::api_version_minor(props.api_version)
            ));
        }
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v12);
        // SAFETY: as above.
        unsafe { self.instance.get_physical_device_features2(pd, &mut f2) };
        if v12.timeline_semaphore == vk::FALSE {
            return Err("device has no timeline semaphores".into());
        }
        // SAFETY: as above.
        let fams = unsafe {
            self.instance
                .get_physical_device_queue_family_properties(pd)
        };
        if !fams
            .iter()
            .any(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
        {
            return Err("device has no compute queue".into());
        }
        Ok(())
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: owners drop every child object (the device) before the instance.
        unsafe {
            if let Some((du, m)) = self.debug.take() {
                du.destroy_debug_utils_messenger(m, None);
            }
            self.instance.destroy_instance(None);
        }
    }
}

/// A queue and its family.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Queue {
    pub family: u32,
    pub queue: vk::Queue,
    /// Valid bits of timestamps written on this queue (0: none).
    pub timestamp_bits: u32,
}

/// The logical device and what lowsync knows about it.
pub(crate) struct Device {
    pub device: ash::Device,
    pub pdev: vk::PhysicalDevice,
    pub name: String,
    pub uuid: [u8; 16],
    pub limits: vk::PhysicalDeviceLimits,
    pub compute: Queue,
    /// A dedicated transfer queue (a family without COMPUTE or GRAPHICS), when present.
    pub transfer: Option<Queue>,
    /// `shaderFloat64` is enabled (RoPE angles are formed in f64).
    pub has_f64: bool,
    /// `hostQueryReset` is enabled (timestamp queries can be reset from the host, which a
    /// transfer-only queue cannot do in a command buffer).
    pub host_query_reset: bool,
    /// Every DEVICE_LOCAL memory type is also HOST_VISIBLE (integrated GPUs, lavapipe).
    pub uma: bool,
    /// The compute stage has basic and arithmetic subgroup operations (Vulkan 1.1 core
    /// properties), so kernels may reduce with `subgroupAdd`.
    pub subgroup_arith: bool,
    /// Besides, shuffles, and a subgroup size from 4 to 64 that divides 64, so a 64-invocation
    /// workgroup is whole subgroups of at least four lanes (`mul_mat_q_s`).
    pub subgroup_shuffle: bool,
    /// `LOWSYNC_VK_COOPMAT` asked for cooperative matrices and the device has them for 16x16x16
    /// f16 x f16 + f32 in 32-lane subgroups, with what the kernels' SPIR-V declares (16-bit
    /// storage, f16 arithmetic, the Vulkan memory model): all enabled at creation.
    pub coopmat: bool,
    /// `shaderIntegerDotProduct` (Vulkan 1.3) is enabled, so kernels may take 4-byte integer
    /// dot products (`mul_mat_vec_qd*`: naga writes `dot4I8Packed` as OpSDot).
    pub integer_dot: bool,
    /// The device runs 4x8-bit packed signed and unsigned dot products in hardware
    /// (`integerDotProduct4x8BitPacked{Signed,Unsigned}Accelerated`); lavapipe emulates them.
    pub integer_dot_fast: bool,
    /// The device reports itself as a CPU (`VK_PHYSICAL_DEVICE_TYPE_CPU`: lavapipe, SwiftShader).
    pub cpu_type: bool,
    /// Multiprocessors, where the device says (`VK_NV_shader_sm_builtins`' SMs,
    /// `VK_AMD_shader_core_properties`' compute units); 0 where it does not.
    pub sm_count: u32,
    // Declared last: dropped after `device` is destroyed (see `Drop`).
    pub inst: Instance,
}

impl Device {
    pub(crate) fn open(config: &VkConfig) -> Result<Self> {
        let inst = Instance::new(config.validation)?;
        let devices = inst.devices()?;
        if devices.is_empty() {
            return Err(unavailable("the Vulkan loader reports no device"));
        }
        let Some(&(pdev, ref usable)) = devices.get(config.device_index) else {
            return Err(unavailable(format!(
                "no Vulkan device {} (this machine has {})",
                config.device_index,
                devices.len()
            )));
        };
        if let Err(why) = usable {
            return Err(unavailable(format!(
                "device {}: {why}",
                config.device_index
            )));
        }
        let ins = &inst.instance;
        // SAFETY: queries on a physical device of this instance.
        let (props, fams, mem) = unsafe {
            (
                ins.get_physical_device_properties(pdev),
                ins.get_physical_device_queue_family_properties(pdev),
                ins.get_physical_device_memory_properties(pdev),
            )
        };
        let name = props
            .device_name_as_c_str()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown".into());
        let find = |want: vk::QueueFlags, avoid: vk::QueueFlags| {
            fams.iter()
                .position(|f| f.queue_flags.contains(want) && !f.queue_flags.intersects(avoid))
        };
        let compute_family = find(vk::QueueFlags::COMPUTE, vk::QueueFlags::GRAPHICS)
            .or_else(|| find(vk::QueueFlags::COMPUTE, vk::QueueFlags::empty()))
            .ok_or_else(|| unavailable("device has no compute queue"))?;
        let transfer_family = find(
            vk::QueueFlags::TRANSFER,
            vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS,
        )
        .filter(|&f| f != compute_family);
        let core = {
            // SAFETY: as above.
            let f = unsafe { ins.get_physical_device_features(pdev) };
            vk::PhysicalDeviceFeatures::default().shader_float64(f.shader_float64 == vk::TRUE)
        };
        let has_f64 = core.shader_float64 == vk::TRUE;
        let (subgroup_arith, subgroup_shuffle) = {
            let mut sg = vk::PhysicalDeviceSubgroupProperties::default();
            let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut sg);
            // SAFETY: a query on a physical device of this instance (Vulkan >= 1.2, checked).
            unsafe { ins.get_physical_device_properties2(pdev, &mut p2) };
            let ops = vk::SubgroupFeatureFlags::BASIC | vk::SubgroupFeatureFlags::ARITHMETIC;
            let arith = sg.supported_stages.contains(vk::ShaderStageFlags::COMPUTE)
                && sg.supported_operations.contains(ops);
            let size = sg.subgroup_size;
            let shuffle = arith
                && sg
                    .supported_operations
                    .contains(vk::SubgroupFeatureFlags::SHUFFLE)
                && (4..=64).contains(&size)
                && 64 % size == 0;
            (arith, shuffle)
        };
        let coopmat = config.coopmat && coopmat_support(ins, pdev)?;
        let (integer_dot, integer_dot_fast) = integer_dot_support(ins, pdev);
        let sm_count = sm_count(ins, pdev)?;
        let prio = [1.0f32];
        let mut qinfos = vec![vk::DeviceQueueCreateInfo::default()
            .queue_family_index(compute_family as u32)
            .queue_priorities(&prio)];
        if let Some(t) = transfer_family {
            qinfos.push(
                vk::DeviceQueueCreateInfo::default()
                    .queue_family_index(t as u32)
                    .queue_priorities(&prio),
            );
        }
        let host_query_reset = {
            let mut have = vk::PhysicalDeviceVulkan12Features::default();
            let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut have);
            // SAFETY: a query on a physical device of this instance.
            unsafe { ins.get_physical_device_features2(pdev, &mut f2) };
            have.host_query_reset == vk::TRUE
        };
        let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
            .timeline_semaphore(true)
            .host_query_reset(host_query_reset)
            .shader_float16(coopmat)
            .vulkan_memory_model(coopmat);
        let mut v11 = vk::PhysicalDeviceVulkan11Features::default()
            .storage_buffer16_bit_access(coopmat)
            .uniform_and_storage_buffer16_bit_access(coopmat);
        let mut v13 =
            vk::PhysicalDeviceVulkan13Features::default().shader_integer_dot_product(true);
        let mut cm =
            vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        let extensions = [ash::khr::cooperative_matrix::NAME.as_ptr()];
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&qinfos)
            .enabled_features(&core)
            .push_next(&mut v12)
            .push_next(&mut v11);
        if coopmat {
            info = info.enabled_extension_names(&extensions).push_next(&mut cm);
        }
        if integer_dot {
            info = info.push_next(&mut v13);
        }
        // SAFETY: `info` and everything it points to outlive the call.
        let device = unsafe { ins.create_device(pdev, &info, None) }
            .map_err(|r| vk_err("vkCreateDevice", r))?;
        let device = match config.entry_point_hook {
            None => device,
            Some(hook) => {
                let gdpa = ins.fp_v1_0().get_device_proc_addr;
                let raw = device.handle();
                // SAFETY: every entry point is looked up for this device and passed through
                // the caller's hook, which must return a function of the same signature.
                unsafe {
                    ash::Device::load_with(
                        |n| {
                            let real = gdpa(raw, n.as_ptr())
                                .map_or(std::ptr::null(), |f| f as *const c_void);
                            hook(n, real)
                        },
                        raw,
                    )
                }
            }
        };
        let queue = |family: usize| Queue {
            family: family as u32,
            // SAFETY: queue 0 of a family requested in `qinfos`.
            queue: unsafe { device.get_device_queue(family as u32, 0) },
            timestamp_bits: fams[family].timestamp_valid_bits,
        };
        let compute = queue(compute_family);
        let transfer = transfer_family.map(queue);
        let types = &mem.memory_types[..mem.memory_type_count as usize];
        let uma = types.iter().all(|t| {
            !t.property_flags
                .contains(vk::MemoryPropertyFlags::DEVICE_LOCAL)
                || t.property_flags
                    .contains(vk::MemoryPropertyFlags::HOST_VISIBLE)
        });
        tracing::info!(
            device = %name,
            compute_family,
            transfer_family = ?transfer_family,
            has_f64,
            uma,
            subgroup_arith,
            subgroup_shuffle,
            coopmat,
            integer_dot,
            integer_dot_fast,
            sm_count,
            "Vulkan device opened"
        );
        Ok(Device {
            device,
            pdev,
            name,
            uuid: props.pipeline_cache_uuid,
            limits: props.limits,
            compute,
            transfer,
            has_f64,
            host_query_reset,
            uma,
            subgroup_arith,
            subgroup_shuffle,
            coopmat,
            integer_dot,
            integer_dot_fast,
            cpu_type: props.device_type == vk::PhysicalDeviceType::CPU,
            sm_count,
            inst,
        })
    }

    pub(crate) fn instance(&self) -> &ash::Instance {
        &self.inst.instance
    }
}

/// Whether `pdev` runs the cooperative-matrix prefill products (`mul_mat_cm`, `mul_mat_qcm`):
/// `VK_KHR_cooperative_matrix` with a 16x16x16 configuration of f16 A and B, f32 C and result
/// in subgroup scope; the features their SPIR-V needs (the extension's, `shaderFloat16`,
/// `vulkanMemoryModel`, 16-bit storage-buffer access); and 32-lane subgroups (a workgroup of
/// 128 invocations is the kernels' four subgroups).
fn coopmat_support(ins: &ash::Instance, pdev: vk::PhysicalDevice) -> Result<bool> {
    // SAFETY: queries on a physical device of this instance.
    let exts = unsafe { ins.enumerate_device_extension_properties(pdev) }
        .map_err(|r| vk_err("vkEnumerateDeviceExtensionProperties", r))?;
    let has_ext = exts
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(ash::khr::cooperative_matrix::NAME));
    if !has_ext {
        return Ok(false);
    }
    let cm = ash::khr::cooperative_matrix::Instance::new(entry()?, ins);
    // SAFETY: the extension is present on this physical device (checked above).
    let configs = unsafe { cm.get_physical_device_cooperative_matrix_properties(pdev) }
        .map_err(|r| vk_err("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", r))?;
    let f16 = vk::ComponentTypeKHR::FLOAT16;
    let f32 = vk::ComponentTypeKHR::FLOAT32;
    let has_config = configs.iter().any(|c| {
        (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
            && (c.a_type, c.b_type, c.c_type, c.result_type) == (f16, f16, f32, f32)
            && c.scope == vk::ScopeKHR::SUBGROUP
            && c.saturating_accumulation == vk::FALSE
    });
    let mut cmf = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut v11 = vk::PhysicalDeviceVulkan11Features::default();
    let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default()
        .push_next(&mut cmf)
        .push_next(&mut v11)
        .push_next(&mut v12);
    // SAFETY: as above; every struct chained is one this Vulkan version knows.
    unsafe { ins.get_physical_device_features2(pdev, &mut f2) };
    let mut sg = vk::PhysicalDeviceSubgroupProperties::default();
    let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut sg);
    // SAFETY: as above.
    unsafe { ins.get_physical_device_properties2(pdev, &mut p2) };
    Ok(has_config
        && cmf.cooperative_matrix == vk::TRUE
        && v12.shader_float16 == vk::TRUE
        && v12.vulkan_memory_model == vk::TRUE
        && v11.storage_buffer16_bit_access == vk::TRUE
        && v11.uniform_and_storage_buffer16_bit_access == vk::TRUE
        && sg.subgroup_size == 32)
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: owners destroy every object created from the device before dropping it.
        unsafe { self.device.destroy_device(None) };
    }
}

/// The device's multiprocessor count where it reports one, else 0: NVIDIA's SMs
/// (`VK_NV_shader_sm_builtins`), AMD's compute units (`VK_AMD_shader_core_properties`: shader
/// engines x arrays per engine x units per array).
fn sm_count(ins: &ash::Instance, pdev: vk::PhysicalDevice) -> Result<u32> {
    // SAFETY: a query on a physical device of this instance.
    let exts = unsafe { ins.enumerate_device_extension_properties(pdev) }
        .map_err(|r| vk_err("vkEnumerateDeviceExtensionProperties", r))?;
    let has = |name: &CStr| exts.iter().any(|e| e.extension_name_as_c_str() == Ok(name));
    if has(ash::nv::shader_sm_builtins::NAME) {
        let mut sm = vk::PhysicalDeviceShaderSMBuiltinsPropertiesNV::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut sm);
        // SAFETY: as above; the extension is present, so its properties struct may be chained.
        unsafe { ins.get_physical_device_properties2(pdev, &mut p2) };
        return Ok(sm.shader_sm_count);
    }
    if has(ash::amd::shader_core_properties::NAME) {
        let mut core = vk::PhysicalDeviceShaderCorePropertiesAMD::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut core);
        // SAFETY: as above.
        unsafe { ins.get_physical_device_properties2(pdev, &mut p2) };
        let units = core
            .shader_engine_count
            .saturating_mul(core.shader_arrays_per_engine_count)
            .saturating_mul(core.compute_units_per_shader_array);
        return Ok(units);
    }
    Ok(0)
}

/// Whether the device has Vulkan 1.3's `shaderIntegerDotProduct` (enabled at creation when it
/// does), and whether it accelerates the 4x8-bit packed forms the integer-dot products take.
fn integer_dot_support(ins: &ash::Instance, pdev: vk::PhysicalDevice) -> (bool, bool) {
    // SAFETY: a query on a physical device of this instance.
    let props = unsafe { ins.get_physical_device_properties(pdev) };
    if props.api_version < vk::API_VERSION_1_3 {
        return (false, false);
    }
    let mut v13 = vk::PhysicalDeviceVulkan13Features::default();
    let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v13);
    // SAFETY: as above; the chain outlives the call.
    unsafe { ins.get_physical_device_features2(pdev, &mut f2) };
    if v13.shader_integer_dot_product != vk::TRUE {
        return (false, false);
    }
    let mut dp = vk::PhysicalDeviceShaderIntegerDotProductProperties::default();
    let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut dp);
    // SAFETY: as above.
    unsafe { ins.get_physical_device_properties2(pdev, &mut p2) };
    let fast = dp.integer_dot_product4x8_bit_packed_signed_accelerated == vk::TRUE
        && dp.integer_dot_product4x8_bit_packed_unsigned_accelerated == vk::TRUE;
    (true, fast)
}
