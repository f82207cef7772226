//! Compiles the WGSL compute shaders in `shaders/` to SPIR-V with naga (pure Rust, no system
//! shader compiler), one module per dtype variant.
//!
//! Why: a fresh machine must build the wheel with `pip install .` alone, so no `glslc` may be
//! assumed. WGSL has no preprocessor and naga resolves no specialisation constants for us, so
//! this script is the preprocessor: each kernel template (`shaders/<kernel>.wgsl`) names its
//! storage bindings as slots (`d`, `a`, `b`, ...) and uses accessors (`ld_a(i) -> f32`,
//! `ld4_a(i) -> vec4<f32>` for 4 consecutive elements, `i` even for 16-bit storage,
//! `st_d(i, v)`, `ldi_ids(i) -> i32`, `dq_b(blk, j)` / `qdot_b` for GGUF blocks; each
//! `// #include <file>` line pulls in a shared part); for every dtype combination listed in
//! [`KERNELS`] the script prepends the binding declarations and accessors for those dtypes plus
//! `shaders/common.wgsl`, validates the module with naga, and writes the SPIR-V words.
//!
//! Invariants: 16-bit storage (f16, bf16) is read and written as packed `u32` words, so no
//! device feature beyond core Vulkan is needed; 16-bit stores use atomics on the word so two
//! threads writing the two halves never lose an update. Binding `k` of a module is slot `k` of
//! its list, which is the order `src/ops.rs` binds tensors in.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy)]
enum Slot {
    /// A float tensor read through `ld_<name>(i) -> f32`.
    In,
    /// A float tensor written through `st_<name>(i, v)`.
    Out,
    /// An i32 tensor read through `ldi_<name>(i) -> i32`.
    Int,
    /// An i32 tensor written through `sti_<name>(i, v)`.
    IntOut,
    /// 32-bit words read raw (`ldr_<name>`), for exact i32/f32 copies.
    Raw,
    /// 32-bit words written raw (`str_<name>`).
    RawOut,
    /// The error-status words (`array<atomic<u32>>`) of index-checking kernels.
    Status,
    /// Raw GGUF blocks read as bytes out of `u32` words: constants `QK_<name>` (elements per
    /// block) and `QB_<name>` (bytes per block), `dq_<name>(blk, j) -> f32` (element `j` of the
    /// block at byte `blk`).
    Quant,
    /// [`Slot::Quant`] plus `qdot_<name>(blk, a_base, k) -> f32`: the block's dot product with
    /// elements `k ..` of x, read through the kernel's `x4(a_base, k) -> vec4<f32>`.
    QuantDot,
}

const FLOATS: &[&str] = &["f32", "f16", "bf16"];
/// Block types with Vulkan kernels (`src/backend.rs::VK_QUANTS` lists the same).
const QUANTS: &[&str] = &["q4_0", "q4_1", "q8_0"];

/// (kernel template, slots: name, kind, dtypes to generate).
type Spec = (
    &'static str,
    &'static [(&'static str, Slot, &'static [&'static str])],
);

const KERNELS: &[Spec] = &[
    (
        "eltwise",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "copy_raw",
        &[("d", Slot::RawOut, &["u32"]), ("a", Slot::Raw, &["u32"])],
    ),
    (
        "rms_norm",
        &[("d", Slot::Out, FLOATS), ("a", Slot::In, FLOATS)],
    ),
    (
        "soft_max",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("m", Slot::In, FLOATS),
        ],
    ),
    (
        "rope",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("pos", Slot::Int, &["i32"]),
        ],
    ),
    (
        "rope_f32",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("pos", Slot::Int, &["i32"]),
        ],
    ),
    (
        "argmax",
        &[("d", Slot::IntOut, &["i32"]), ("a", Slot::In, FLOATS)],
    ),
    (
        "get_rows",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "set_rows",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_k",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_k_wg",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
        ],
    ),
    (
        "mul_mat_vec_q",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::QuantDot, QUANTS),
        ],
    ),
    (
        "mul_mat_vec_q_wg",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("b", Slot::QuantDot, QUANTS),
        ],
    ),
    (
        "get_rows_q",
        &[
            ("d", Slot::Out, FLOATS),
            ("a", Slot::Quant, QUANTS),
            ("ids", Slot::Int, &["i32"]),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "mul_mat_id",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, FLOATS),
            ("b", Slot::In, FLOATS),
            ("ids", Slot::Int, &["i32"]),
            ("w", Slot::In, FLOATS),
            ("status", Slot::Status, &["u32"]),
        ],
    ),
    (
        "penalize",
        &[
            ("d", Slot::Out, &["f32"]),
            ("a", Slot::In, &["f32"]),
            ("hist", Slot::Int, &["i32"]),
            ("par", Slot::In, &["f32"]),
        ],
    ),
    (
        "sample",
        &[
            ("d", Slot::IntOut, &["i32"]),
            ("a", Slot::In, &["f32"]),
            ("par", Slot::In, &["f32"]),
            ("key", Slot::Int, &["i32"]),
        ],
    ),
];

fn main() {
    // Read at run time: a build-script binary cached in a shared target dir may have been
    // compiled for a clone at another path.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("shaders");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", dir.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let common = read(&dir.join("common.wgsl"));
    let mut table = String::from("/// (variant name, SPIR-V bytes) of every compiled kernel.\n");
    table.push_str("pub(crate) static SPIRV: &[(&str, &[u8])] = &[\n");
    let mut failures = Vec::new();
    for (kernel, slots) in KERNELS {
        let body = includes(&dir, &read(&dir.join(format!("{kernel}.wgsl"))));
        println!(
            "cargo:rerun-if-changed={}",
            dir.join(format!("{kernel}.wgsl")).display()
        );
        for combo in combinations(slots) {
            let name = variant_name(kernel, slots, &combo);
            let mut src = String::new();
            for (k, ((slot, kind, _), dt)) in slots.iter().zip(&combo).enumerate() {
                src.push_str(&binding(k, slot, *kind, dt));
            }
            src.push_str(&common);
            src.push_str(&body);
            match compile(&src) {
                Ok(words) => {
                    let file = out.join(format!("{name}.spv"));
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    std::fs::write(&file, bytes).expect("write spv");
                    let _ = writeln!(
                        table,
                        "    ({name:?}, include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{name}.spv\"))),"
                    );
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
    }
    table.push_str("];\n");
    if !failures.is_empty() {
        panic!("shader compilation failed:\n{}", failures.join("\n"));
    }
    std::fs::write(out.join("shaders.rs"), table).expect("write shaders.rs");
}

/// Replaces each `// #include <file>` line of a template by that file of `shaders/` (one
/// level; enough for two kernels sharing a body).
fn includes(dir: &Path, body: &str) -> String {
    let mut out = String::new();
    for line in body.lines() {
        match line.trim().strip_prefix("// #include ") {
            Some(file) => {
                let path = dir.join(file.trim());
                println!("cargo:rerun-if-changed={}", path.display());
                out.push_str(&read(&path));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn combinations(slots: &[(&str, Slot, &[&'static str])]) -> Vec<Vec<&'static str>> {
    let mut out: Vec<Vec<&'static str>> = vec![Vec::new()];
    for (_, _, dts) in slots {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                dts.iter().map(move |d| {
                    let mut v = prefix.clone();
                    v.push(*d);
                    v
                })
            })
            .collect();
    }
    out
}

/// `kernel.slot_dtype.slot_dtype...`, the key `src/pipelines.rs` looks variants up by.
fn variant_name(kernel: &str, slots: &[(&str, Slot, &[&str])], combo: &[&str]) -> String {
    let mut s = kernel.to_string();
    for ((slot, _, _), dt) in slots.iter().zip(combo) {
        let _ = write!(s, ".{slot}_{dt}");
    }
    s
}

/// The declaration of binding `k` and its accessors.
fn binding(k: usize, n: &str, kind: Slot, dt: &str) -> String {
    let decl = |access: &str, elem: &str| {
        format!("@group(0) @binding({k}) var<storage, {access}> {n}_buf: array<{elem}>;\n")
    };
    match (kind, dt) {
        (Slot::In, "f32") => {
            decl("read", "f32")
                + &format!("fn ld_{n}(i: u32) -> f32 {{ return {n}_buf[i]; }}\n")
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ return vec4<f32>({n}_buf[i], {n}_buf[i + 1u], {n}_buf[i + 2u], {n}_buf[i + 3u]); }}\n"
                )
        }
        (Slot::In, "f16") => {
            decl("read", "u32")
                + &format!(
                    "fn ld_{n}(i: u32) -> f32 {{ return f16_bits_to_f32(({n}_buf[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu); }}\n"
                )
                // `i` even: two whole words; f16 -> f32 is exact, so this equals `ld_` x4.
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ let w = i >> 1u; return vec4<f32>(unpack2x16float({n}_buf[w]), unpack2x16float({n}_buf[w + 1u])); }}\n"
                )
        }
        (Slot::In, "bf16") => {
            decl("read", "u32")
                + &format!(
                    "fn ld_{n}(i: u32) -> f32 {{ return bitcast<f32>((({n}_buf[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu) << 16u); }}\n"
                )
                // `i` even: two whole words.
                + &format!(
                    "fn ld4_{n}(i: u32) -> vec4<f32> {{ let w0 = {n}_buf[i >> 1u]; let w1 = {n}_buf[(i >> 1u) + 1u]; return bitcast<vec4<f32>>(vec4<u32>(w0 << 16u, w0 & 0xffff0000u, w1 << 16u, w1 & 0xffff0000u)); }}\n"
                )
        }
        (Slot::Out, "f32") => decl("read_write", "f32")
            + &format!("fn st_{n}(i: u32, v: f32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Out, half) => {
            let conv = if half == "f16" {
                "f32_to_f16_bits"
            } else {
                "f32_to_bf16_bits"
            };
            decl("read_write", "atomic<u32>")
                + &format!(
                    "fn st_{n}(i: u32, v: f32) {{\n\
                     \x20   let sh = (i & 1u) * 16u;\n\
                     \x20   atomicAnd(&{n}_buf[i >> 1u], ~(0xffffu << sh));\n\
                     \x20   atomicOr(&{n}_buf[i >> 1u], {conv}(v) << sh);\n\
                     }}\n"
                )
        }
        (Slot::Int, _) => decl("read", "i32")
            + &format!("fn ldi_{n}(i: u32) -> i32 {{ return {n}_buf[i]; }}\n"),
        (Slot::IntOut, _) => decl("read_write", "i32")
            + &format!("fn sti_{n}(i: u32, v: i32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Raw, _) => decl("read", "u32")
            + &format!("fn ldr_{n}(i: u32) -> u32 {{ return {n}_buf[i]; }}\n"),
        (Slot::RawOut, _) => decl("read_write", "u32")
            + &format!("fn str_{n}(i: u32, v: u32) {{ {n}_buf[i] = v; }}\n"),
        (Slot::Status, _) => {
            decl("read_write", "atomic<u32>")
                + "// Records the first index error of a submit: [count, tag, position, value].\n\
                   fn report_bad_index(tag: u32, pos: u32, value: i32) {\n\
                   \x20   let old = atomicAdd(&status_buf[0], 1u);\n\
                   \x20   if old == 0u {\n\
                   \x20       atomicStore(&status_buf[1], tag);\n\
                   \x20       atomicStore(&status_buf[2], pos);\n\
                   \x20       atomicStore(&status_buf[3], bitcast<u32>(value));\n\
                   \x20   }\n\
                   }\n"
        }
        (Slot::Quant, q) => decl("read", "u32") + &quant(n, q, false),
        (Slot::QuantDot, q) => decl("read", "u32") + &quant(n, q, true),
        (Slot::In, other) => panic!("unknown input dtype {other}"),
    }
}

/// The accessors of a block-dtype binding `n` (see [`Slot::Quant`]). Blocks are 18/20/34
/// bytes, so a block starts at any byte of a word: every read goes through `ldw_<n>`, four
/// bytes from any byte offset, which touches only the words holding those bytes (so never a
/// word past the tensor's last byte). Layouts as the CPU oracle
/// (`lowsync-cpu/src/kernels/quant/scalar.rs`): Q4_0 = f16 d, 16 bytes of nibbles (element
/// j < 16 the low nibble of byte j, j >= 16 the high nibble of byte j - 16), (q - 8) * d;
/// Q4_1 = f16 d, f16 m, 16 bytes, q * d + m; Q8_0 = f16 d, 32 i8, q * d.
fn quant(n: &str, q: &str, dot: bool) -> String {
    let (qk, qb) = match q {
        "q4_0" => (32, 18),
        "q4_1" => (32, 20),
        "q8_0" => (32, 34),
        other => panic!("unknown block dtype {other}"),
    };
    let mut s = format!(
        "const QK_{n}: u32 = {qk}u;\n\
         const QB_{n}: u32 = {qb}u;\n\
         fn ldw_{n}(byte: u32) -> u32 {{\n\
         \x20   let sh = (byte & 3u) * 8u;\n\
         \x20   let w0 = {n}_buf[byte >> 2u];\n\
         \x20   let w1 = {n}_buf[(byte + 3u) >> 2u];\n\
         \x20   return select((w0 >> sh) | (w1 << ((32u - sh) & 31u)), w0, sh == 0u);\n\
         }}\n\
         fn ldh_{n}(byte: u32) -> f32 {{ return f16_bits_to_f32(ldw_{n}(byte) & 0xffffu); }}\n"
    );
    // Nibble and byte lanes of one word, in element order.
    let lo = "vec4<f32>(vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u))";
    let hi = "vec4<f32>(vec4<u32>(q >> 4u, q >> 12u, q >> 20u, q >> 28u) & vec4<u32>(15u))";
    let (dq, qdot) = match q {
        "q4_0" => (
            format!(
                "fn dq_{n}(blk: u32, j: u32) -> f32 {{\n\
                 \x20   let q = (ldw_{n}(blk + 2u + (j & 15u)) >> ((j >> 4u) * 4u)) & 15u;\n\
                 \x20   return ldh_{n}(blk) * (f32(q) - 8.0);\n\
                 }}\n"
            ),
            format!(
                "fn qdot_{n}(blk: u32, a_base: u32, k: u32) -> f32 {{\n\
                 \x20   var s = vec4<f32>(0.0);\n\
                 \x20   for (var w = 0u; w < 4u; w++) {{\n\
                 \x20       let q = ldw_{n}(blk + 2u + 4u * w);\n\
                 \x20       s = fma(x4(a_base, k + 4u * w), {lo} - 8.0, s);\n\
                 \x20       s = fma(x4(a_base, k + 16u + 4u * w), {hi} - 8.0, s);\n\
                 \x20   }}\n\
                 \x20   return ldh_{n}(blk) * ((s.x + s.y) + (s.z + s.w));\n\
                 }}\n"
            ),
        ),
        // d * sum(q x) + m * sum(x): the min costs one add per element, not a multiply.
        "q4_1" => (
            format!(
                "fn dq_{n}(blk: u32, j: u32) -> f32 {{\n\
                 \x20   let q = (ldw_{n}(blk + 4u + (j & 15u)) >> ((j >> 4u) * 4u)) & 15u;\n\
                 \x20   return ldh_{n}(blk) * f32(q) + ldh_{n}(blk + 2u);\n\
                 }}\n"
            ),
            format!(
                "fn qdot_{n}(blk: u32, a_base: u32, k: u32) -> f32 {{\n\
                 \x20   var s = vec4<f32>(0.0);\n\
                 \x20   var sx = vec4<f32>(0.0);\n\
                 \x20   for (var w = 0u; w < 4u; w++) {{\n\
                 \x20       let q = ldw_{n}(blk + 4u + 4u * w);\n\
                 \x20       let x0 = x4(a_base, k + 4u * w);\n\
                 \x20       let x1 = x4(a_base, k + 16u + 4u * w);\n\
                 \x20       s = fma(x0, {lo}, fma(x1, {hi}, s));\n\
                 \x20       sx += x0 + x1;\n\
                 \x20   }}\n\
                 \x20   let dm = ldw_{n}(blk);\n\
                 \x20   return f16_bits_to_f32(dm & 0xffffu) * ((s.x + s.y) + (s.z + s.w))\n\
                 \x20       + f16_bits_to_f32(dm >> 16u) * ((sx.x + sx.y) + (sx.z + sx.w));\n\
                 }}\n"
            ),
        ),
        // `extractBits` of an i32 sign-extends, so each byte is its i8.
        "q8_0" => (
            format!(
                "fn dq_{n}(blk: u32, j: u32) -> f32 {{\n\
                 \x20   let q = extractBits(bitcast<i32>(ldw_{n}(blk + 2u + j)), 0u, 8u);\n\
                 \x20   return f32(q) * ldh_{n}(blk);\n\
                 }}\n"
            ),
            format!(
                "fn qdot_{n}(blk: u32, a_base: u32, k: u32) -> f32 {{\n\
                 \x20   var s = vec4<f32>(0.0);\n\
                 \x20   for (var w = 0u; w < 8u; w++) {{\n\
                 \x20       let q = bitcast<i32>(ldw_{n}(blk + 2u + 4u * w));\n\
                 \x20       let v = vec4<i32>(extractBits(q, 0u, 8u), extractBits(q, 8u, 8u), \
                 extractBits(q, 16u, 8u), q >> 24u);\n\
                 \x20       s = fma(x4(a_base, k + 4u * w), vec4<f32>(v), s);\n\
                 \x20   }}\n\
                 \x20   return ldh_{n}(blk) * ((s.x + s.y) + (s.z + s.w));\n\
                 }}\n"
            ),
        ),
        _ => unreachable!("checked above"),
    };
    s.push_str(&dq);
    if dot {
        s.push_str(&qdot);
    }
    s
}

fn compile(src: &str) -> Result<Vec<u32>, String> {
    use naga::back::spv;
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = Validator::new(
        ValidationFlags::all(),
        // SUBGROUP: only `mul_mat_vec_k` and `mul_mat_vec_q` use subgroup operations, and the
        // host picks them only on a device whose compute stage has subgroup arithmetic. SHADER_FLOAT16_IN_FLOAT32 is
        // `unpack2x16float` (GLSL.std.450 UnpackHalf2x16, core SPIR-V for Vulkan).
        Capabilities::IMMEDIATES
            | Capabilities::FLOAT64
            | Capabilities::SUBGROUP
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32,
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(src))?;
    let options = spv::Options {
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        // Host code validates every extent before a dispatch; kernels index in bounds.
        bounds_check_policies: naga::proc::BoundsCheckPolicies::default(),
        force_loop_bounding: false,
        emit_int_div_checks: false,
        ..Default::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| format!("{e}"))
}
