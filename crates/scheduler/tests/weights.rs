//! Weights read in place: a `cpu`/`cpu-async` weight buffer aliases the graph's weight bytes
//! (pointer equality, no upload), computes exactly what the copying path computes, is made
//! once per context, refuses writes, copies bytes too misaligned to alias, and keeps borrowed
//! bytes alive exactly as long as the context needs them.

#[allow(unused_imports)] // the deadline helpers are for the ordering tests
mod common;

use std::sync::Arc;

use common::Masked;
use half::f16;
use lowsync_backend::{Backend, BufferId, Caps};
use lowsync_cpu::{CpuAsyncBackend, CpuBackend};
use lowsync_graph::{BorrowedBytes, DType, Graph, Op, TensorId, WeightBytes};
use lowsync_scheduler::{Plan, Sched, SyncPolicy};

const K: usize = 64;
const N: usize = 8;
const ROWS: usize = 3;

/// Bytes owned elsewhere (a stand-in for a memory map): `len` of them at `offset`.
struct Held {
    data: Vec<u8>,
    offset: usize,
    len: usize,
}

impl BorrowedBytes for Held {
    fn bytes(&self) -> &[u8] {
        &self.data[self.offset..self.offset + self.len]
    }
}

/// `bytes` borrowed from a `Held` that starts them at an address `misalign` bytes past a
/// 64-byte boundary; the `Held` is returned too, to watch its reference count.
fn borrowed(bytes: &[u8], misalign: usize) -> (WeightBytes, Arc<Held>) {
    let mut data = vec![0u8; bytes.len() + 128];
    let base = data.as_ptr() as usize;
    let offset = (64 - base % 64) % 64 + misalign;
    data[offset..offset + bytes.len()].copy_from_slice(bytes);
    let held = Arc::new(Held {
        data,
        offset,
        len: bytes.len(),
    });
    (WeightBytes::borrowed(held.clone()), held)
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f16_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter()
        .flat_map(|x| f16::from_f32(x).to_ne_bytes())
        .collect()
}

/// `N` rows of `K` Q8_0 values (blocks of a 0.05 scale and 32 signed bytes).
fn q8_0_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    for r in 0..N {
        for b in 0..K / 32 {
            out.extend_from_slice(&f16::from_f32(0.05).to_le_bytes());
            out.extend((0..32).map(|j| (((r * 7 + b * 5 + j * 3) % 31) as i8 - 15) as u8));
        }
    }
    out
}

/// The weights of [`graph`]: name, dtype, shape and bytes.
fn weight_data() -> Vec<(&'static str, DType, Vec<usize>, Vec<u8>)> {
    let wave = |n: usize, s: f32| (0..n).map(move |i| ((i * 37 % 101) as f32 - 50.0) * s);
    vec![
        ("w32", DType::F32, vec![N, K], f32_bytes(wave(N * K, 0.01))),
        ("w16", DType::F16, vec![N, K], f16_bytes(wave(N * K, 0.02))),
        ("wq", DType::Q8_0, vec![N, K], q8_0_bytes()),
        (
            "emb",
            DType::F16,
            vec![16, K],
            f16_bytes(wave(16 * K, 0.03)),
        ),
    ]
}

/// `x @ w.T` for each matrix and `emb[ids]`, from the given weight bytes.
fn graph(weights: &[WeightBytes]) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", &[ROWS, K], DType::F32).unwrap();
    let ids = g.input("ids", &[ROWS], DType::I32).unwrap();
    let ws: Vec<TensorId> = weight_data()
        .iter()
        .zip(weights)
        .map(|((name, dt, shape, _), b)| g.weight(name, shape, *dt, b.clone(), None).unwrap())
        .collect();
    for (i, out) in ["y32", "y16", "yq"].iter().enumerate() {
        let wt = g.transpose(ws[i], 0, 1).unwrap();
        let y = g.mul_mat(x, wt).unwrap();
        g.output(out, y).unwrap();
    }
    let rows = g.get_rows(ws[3], ids).unwrap();
    g.output("rows", rows).unwrap();
    g
}

/// Runs one step and returns the outputs' bytes.
fn run(plan: &mut Plan) -> Vec<Vec<u8>> {
    let x = f32_bytes((0..ROWS * K).map(|i| (i % 13) as f32 * 0.1 - 0.6));
    let ids: Vec<u8> = [5i32, 0, 15].iter().flat_map(|v| v.to_ne_bytes()).collect();
    plan.set_input("x", &x).unwrap();
    plan.set_input("ids", &ids).unwrap();
    plan.compute().unwrap();
    ["y32", "y16", "yq", "rows"]
        .iter()
        .map(|o| plan.get_output(o).unwrap())
        .collect()
}

/// The buffer and offset every weight of `plan` is read from, in [`weight_data`] order.
fn weight_refs(plan: &Plan) -> Vec<(BufferId, usize)> {
    let nodes = &plan.exec_graph(0, 0).nodes;
    let matmuls: Vec<_> = nodes.iter().filter(|n| n.op == Op::MulMat).collect();
    let rows = nodes.iter().find(|n| n.op == Op::GetRows).unwrap();
    let mut out: Vec<_> = matmuls
        .iter()
        .map(|n| (n.srcs[1].buffer, n.srcs[1].byte_offset))
        .collect();
    out.push((rows.srcs[0].buffer, rows.srcs[0].byte_offset));
    out
}

/// The host address of a buffer's bytes, where the backend lends it (`cpu` does; `cpu-async`
/// keeps its memory to itself, like a device, so its tests check counts instead).
fn host_addr(b: &dyn Backend, (id, offset): (BufferId, usize)) -> Option<usize> {
    b.buffer_host_ptr(id).map(|p| p.as_ptr() as usize + offset)
}

fn sched(b: Arc<dyn Backend>) -> Arc<Sched> {
    Sched::with_debug_realloc(vec![b], SyncPolicy::Staged, 1, 0).unwrap()
}

/// `cpu` without `alias_weight` (the trait's default): weights are allocated and uploaded.
fn copying() -> Arc<Masked<CpuBackend>> {
    Arc::new(Masked {
        name: "cpu",
        inner: CpuBackend::new(),
        caps: Caps::default(),
        refuse: |_| false,
    })
}

fn hosts() -> Vec<Arc<dyn Backend>> {
    vec![
        Arc::new(CpuBackend::new()),
        Arc::new(CpuAsyncBackend::new("cpu-async").unwrap()),
    ]
}

#[test]
fn a_cpu_weight_buffer_reads_the_bytes_in_place_and_computes_what_a_copy_computes() {
    let data = weight_data();
    let total: usize = data.iter().map(|d| d.3.len()).sum();
    let (bytes, _held): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 0)).unzip();

    // The copying path (a backend without `alias_weight`): one upload per weight.
    let c = copying();
    let cs = sched(c.clone());
    let mut cp = cs.compile(&graph(&bytes)).unwrap();
    let s = c.stats().snapshot();
    assert_eq!((s.h2d_copies, s.h2d_bytes as usize), (4, total));
    for (r, b) in weight_refs(&cp).into_iter().zip(&bytes) {
        assert_ne!(host_addr(&c.inner, r), Some(b.as_ptr() as usize));
    }
    let want = run(&mut cp);

    for h in hosts() {
        let sc = sched(h.clone());
        let mut plan = sc.compile(&graph(&bytes)).unwrap();
        let s = h.stats().snapshot();
        // No upload at all, and as many buffers as the copying path made.
        assert_eq!((s.h2d_copies, s.h2d_bytes), (0, 0), "{}", h.name());
        assert_eq!(s.reserves, c.stats().snapshot().reserves, "{}", h.name());
        if h.name() == "cpu" {
            for (r, b) in weight_refs(&plan).into_iter().zip(&bytes) {
                assert_eq!(host_addr(&*h, r), Some(b.as_ptr() as usize));
            }
        }
        assert_eq!(run(&mut plan), want, "{}", h.name());
    }
}

#[test]
fn a_weight_shared_by_two_plans_is_aliased_once() {
    let (bytes, _held): (Vec<_>, Vec<_>) = weight_data().iter().map(|d| borrowed(&d.3, 0)).unzip();
    // What a second plan adds besides weights (its own buffers), on the copying path.
    let c = copying();
    let cs = sched(c.clone());
    let _first = cs.compile(&graph(&bytes)).unwrap();
    let before = c.stats().snapshot();
    let _second = cs.compile(&graph(&bytes)).unwrap();
    let extra = c.stats().snapshot().since(&before);
    assert_eq!(extra.h2d_copies, 0);
    for h in hosts() {
        let sc = sched(h.clone());
        let mut first = sc.compile(&graph(&bytes)).unwrap();
        let before = h.stats().snapshot();
        let mut second = sc.compile(&graph(&bytes)).unwrap();
        let d = h.stats().snapshot().since(&before);
        assert_eq!(
            (d.reserves, d.h2d_copies),
            (extra.reserves, 0),
            "{}",
            h.name()
        );
        assert_eq!(weight_refs(&first), weight_refs(&second), "{}", h.name());
        assert_eq!(run(&mut first), run(&mut second), "{}", h.name());
    }
}

#[test]
fn weight_bytes_too_misaligned_to_alias_are_copied() {
    let data = weight_data();
    let (aligned, _a): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 0)).unzip();
    // 2 bytes past a 64-byte boundary: aligned for f16 but not for f32 (ALIAS_ALIGNMENT 4).
    let (odd, _o): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 2)).unzip();
    for h in hosts() {
        let want = run(&mut sched(h.clone()).compile(&graph(&aligned)).unwrap());
        h.stats().reset();
        let sc = sched(h.clone());
        let mut plan = sc.compile(&graph(&odd)).unwrap();
        let s = h.stats().snapshot();
        let all: usize = data.iter().map(|d| d.3.len()).sum();
        assert_eq!(
            (s.h2d_copies, s.h2d_bytes as usize),
            (4, all),
            "{}: every weight copied",
            h.name()
        );
        if h.name() == "cpu" {
            for (r, b) in weight_refs(&plan).into_iter().zip(&odd) {
                let at = host_addr(&*h, r).unwrap();
                assert_ne!(at, b.as_ptr() as usize);
            }
        }
        assert_eq!(run(&mut plan), want, "{}", h.name());
    }
}

#[test]
fn an_aliased_buffer_refuses_every_write() {
    let (bytes, held) = borrowed(&[7u8; 64], 0);
    for h in hosts() {
        let id = h.alias_weight(&bytes).unwrap().expect("aliased");
        assert_eq!(h.buffer_size(id).unwrap(), 64);
        let e = h.set_tensor(id, 0, &[1u8; 4]).unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
        if h.caps().set_tensor_async_staged {
            let e = h.set_tensor_async_staged(id, 0, &[1u8; 4]).unwrap_err();
            assert!(e.to_string().contains("read-only"), "{e}");
        }
        if h.caps().copy_async {
            let src = h
                .alloc_buffer(64, lowsync_backend::BufferUsage::Compute)
                .unwrap();
            let e = h.copy_async(src, 0, id, 0, 4).unwrap_err();
            assert!(e.to_string().contains("read-only"), "{e}");
            h.free_buffer(src);
        }
        h.synchronize().unwrap();
        let mut out = [0u8; 64];
        h.get_tensor(id, 0, &mut out).unwrap();
        assert_eq!(out, [7u8; 64], "{}", h.name());
        h.free_buffer(id);
    }
    assert_eq!(Arc::strong_count(&held), 2, "only `bytes` holds it now");
}

#[test]
fn borrowed_bytes_live_as_long_as_the_context_and_no_longer() {
    let data = weight_data();
    for h in hosts() {
        let (bytes, held): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 0)).unzip();
        let sc = sched(h.clone());
        let mut plan = sc.compile(&graph(&bytes)).unwrap();
        drop(bytes);
        // The graph is gone and so is the caller's handle: the buffers keep the bytes, and so
        // does each weight's home in the context (to tell a later weight of the same name with
        // other bytes without hashing these).
        assert!(
            held.iter().all(|x| Arc::strong_count(x) == 3),
            "{}",
            h.name()
        );
        run(&mut plan);
        drop(plan);
        drop(sc);
        assert!(
            held.iter().all(|x| Arc::strong_count(x) == 1),
            "{}",
            h.name()
        );
    }
}

#[test]
fn a_weight_of_the_same_name_needs_the_same_bytes_not_the_same_address() {
    let data = weight_data();
    let (first, _h1): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 0)).unzip();
    let (copy, _h2): (Vec<_>, Vec<_>) = data.iter().map(|d| borrowed(&d.3, 4)).unzip();
    let owned: Vec<WeightBytes> = data
        .iter()
        .map(|d| WeightBytes::from(d.3.clone()))
        .collect();
    for h in hosts() {
        let sc = sched(h.clone());
        let mut a = sc.compile(&graph(&first)).unwrap();
        // The same bytes elsewhere (borrowed or owned) are the same weight.
        let mut b = sc.compile(&graph(&copy)).unwrap();
        let mut c = sc.compile(&graph(&owned)).unwrap();
        assert_eq!(run(&mut a), run(&mut b), "{}", h.name());
        assert_eq!(run(&mut a), run(&mut c), "{}", h.name());
        // Other bytes under a known name are refused, naming the weight.
        let mut other = data[0].3.clone();
        other[0] ^= 1;
        let mut changed = first.clone();
        changed[0] = borrowed(&other, 0).0;
        let err = sc
            .compile(&graph(&changed))
            .err()
            .expect("other bytes refused");
        assert!(err.to_string().contains("with other data"), "{err}");
        changed[0] = WeightBytes::from(other);
        assert!(sc.compile(&graph(&changed)).is_err(), "{}", h.name());
    }
    // A context that first saw owned bytes compares later ones by their hash.
    let sc = sched(hosts()[0].clone());
    sc.compile(&graph(&owned)).unwrap();
    sc.compile(&graph(&first)).unwrap();
    let mut other = data[1].3.clone();
    other[3] ^= 0x10;
    let mut changed = owned.clone();
    changed[1] = borrowed(&other, 0).0;
    assert!(sc.compile(&graph(&changed)).is_err());
}
