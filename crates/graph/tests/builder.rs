//! Builder validation: shape and dtype errors are reported when the node is built and name the
//! op and the shapes; node and leaf counts depend only on the calls made.

use std::sync::Arc;

use lowsync_graph::{DType, Graph, Op, RopeMode};

fn msg<T: std::fmt::Debug>(r: lowsync_graph::Result<T>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn mul_mat_shape_error_names_the_op_and_the_shapes() {
    let mut g = Graph::new();
    let a = g.input("a", &[4, 3], DType::F32).unwrap();
    let b = g.input("b", &[4, 5], DType::F32).unwrap();
    let m = msg(g.mul_mat(a, b));
    assert!(
        m.contains("mul_mat") && m.contains("[4, 3]") && m.contains("[4, 5]"),
        "{m}"
    );
}

#[test]
fn gqa_batch_broadcast_is_accepted_and_other_ratios_are_not() {
    let mut g = Graph::new();
    let q = g.input("q", &[8, 2, 16], DType::F32).unwrap();
    let k = g.input("k", &[2, 16, 5], DType::F32).unwrap();
    let s = g.mul_mat(q, k).unwrap();
    assert_eq!(g.tensor(s).shape(), &[8, 2, 5]);
    let k3 = g.input("k3", &[3, 16, 5], DType::F32).unwrap();
    assert!(msg(g.mul_mat(q, k3)).contains("batch axes"));
}

#[test]
fn dtype_errors_name_the_op() {
    let mut g = Graph::new();
    let x = g.input("x", &[2, 4], DType::F32).unwrap();
    let ids = g.input("ids", &[3], DType::F32).unwrap();
    assert!(msg(g.get_rows(x, ids)).contains("get_rows: ids must be i32"));
    let i = g.input("i", &[2, 4], DType::I32).unwrap();
    assert!(msg(g.silu(i)).contains("silu"));
}

#[test]
fn rope_and_set_rows_validate_their_operands() {
    let mut g = Graph::new();
    let x = g.input("x", &[3, 2, 8], DType::F32).unwrap();
    let pos = g.input("pos", &[4], DType::I32).unwrap();
    assert!(msg(g.rope(x, pos, RopeMode::Normal, 8, 1e4)).contains("positions"));
    let pos3 = g.input("pos3", &[3], DType::I32).unwrap();
    assert!(msg(g.rope(x, pos3, RopeMode::Neox, 7, 1e4)).contains("n_dims 7"));
    let not_persistent = g.input("kv", &[4, 8], DType::F32).unwrap();
    let src = g.input("src", &[1, 8], DType::F32).unwrap();
    let idx = g.input("idx", &[1], DType::I32).unwrap();
    assert!(msg(g.set_rows(not_persistent, src, idx)).contains("persistent"));
}

#[test]
fn views_share_their_root_and_check_bounds() {
    let mut g = Graph::new();
    let x = g.input("x", &[4, 6], DType::F16).unwrap();
    let t = g.transpose(x, 0, 1).unwrap();
    assert_eq!(g.tensor(t).shape(), &[6, 4]);
    assert_eq!(g.tensor(t).root, x);
    assert!(msg(g.reshape(t, &[24])).contains("not contiguous"));
    let s = g.slice(x, 1, 2, 5).unwrap();
    assert_eq!(
        (g.tensor(s).shape(), g.tensor(s).layout.offset),
        (&[4usize, 3][..], 2)
    );
    assert!(msg(g.slice(x, 1, 2, 7)).contains("out of range"));
    assert_eq!(g.tensor(t).op, Op::View);
}

#[test]
fn weight_size_and_duplicate_names_are_checked() {
    let mut g = Graph::new();
    assert!(
        msg(g.weight("w", &[2, 2], DType::F32, Arc::from(vec![0u8; 8]), None)).contains("needs 16")
    );
    g.input("x", &[1], DType::F32).unwrap();
    assert!(msg(g.input("x", &[1], DType::F32)).contains("duplicate"));
}

#[test]
fn node_and_leaf_counts_follow_the_calls_only() {
    let build = || {
        let mut g = Graph::new();
        let x = g.input("x", &[0, 8], DType::F32).unwrap(); // zero rows: same node count
        let w = g
            .weight("w", &[8, 8], DType::F32, Arc::from(vec![0u8; 256]), None)
            .unwrap();
        let y = g.mul_mat(x, w).unwrap();
        let y = g.rms_norm(y, 1e-5).unwrap();
        g.output("y", y).unwrap();
        g
    };
    let g = build();
    assert_eq!((g.n_nodes(), g.n_leafs()), (2, 2));
}

// ---- size arithmetic: what would wrap is refused when the node is built ----------------------

#[test]
fn reshape_refuses_an_element_count_that_wraps() {
    let mut g = Graph::new();
    let w = g
        .weight("w", &[2], DType::F32, Arc::from(vec![0u8; 8]), None)
        .unwrap();
    // (2^63 + 1) * 2 wraps to 2 elements: unchecked, get_rows would then index far past `w`.
    let m = msg(g.reshape(w, &[(1usize << 63) + 1, 2]));
    assert!(m.contains("reshape") && m.contains("too large"), "{m}");
    assert!(g.reshape(w, &[1, 2]).is_ok());
}

#[test]
fn mul_mat_refuses_a_result_whose_bytes_wrap() {
    let mut g = Graph::new();
    let a = g.input("a", &[1 << 31, 0], DType::F32).unwrap();
    let b = g.input("b", &[0, 1 << 31], DType::F32).unwrap();
    // [2^31, 2^31] f32 is 2^64 bytes, which wraps to 0.
    let m = msg(g.mul_mat(a, b));
    assert!(m.contains("mul_mat") && m.contains("too large"), "{m}");
}

#[test]
fn concat_refuses_an_axis_that_overflows() {
    let mut g = Graph::new();
    // Each [2^60, 0] is addressable; together their strides would reach 2^63 bytes.
    let a = g.input("a", &[1 << 60, 0], DType::F32).unwrap();
    let m = msg(g.concat(a, a, 0));
    assert!(m.contains("concat") && m.contains("too large"), "{m}");
    let big = g.input("big", &[usize::MAX, 0], DType::I32);
    assert!(big.is_err(), "strides of [usize::MAX, 0] overflow");
}

#[test]
fn weight_size_check_does_not_wrap() {
    let mut g = Graph::new();
    let m = msg(g.weight(
        "w",
        &[1 << 62, 4],
        DType::F32,
        Arc::from(vec![0u8; 0]),
        None,
    ));
    assert!(m.contains("too large"), "{m}");
}

#[test]
fn rope_refuses_a_base_that_gives_nan() {
    let mut g = Graph::new();
    let x = g.input("x", &[1, 1, 4], DType::F32).unwrap();
    let p = g.input("p", &[1], DType::I32).unwrap();
    for base in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let m = msg(g.rope(x, p, RopeMode::Normal, 4, base));
        assert!(m.contains("theta_base"), "{base}: {m}");
    }
    assert!(g.rope(x, p, RopeMode::Normal, 4, 10000.0).is_ok());
}

fn q4_0_weight(g: &mut Graph, name: &str, shape: &[usize]) -> lowsync_graph::TensorId {
    let n: usize = shape.iter().product();
    let bytes: Arc<[u8]> = vec![0u8; n / 32 * 18].into();
    g.weight(name, shape, DType::Q4_0, bytes, None).unwrap()
}

#[test]
fn quantized_weights_need_whole_blocks_and_exact_bytes() {
    let mut g = Graph::new();
    let w = q4_0_weight(&mut g, "w", &[3, 64]);
    assert_eq!(g.tensor(w).nbytes(), 3 * 2 * 18);
    let short: Arc<[u8]> = vec![0u8; 3 * 2 * 18 - 1].into();
    let m = msg(g.weight("w2", &[3, 64], DType::Q4_0, short, None));
    assert!(m.contains("107 bytes") && m.contains("needs 108"), "{m}");
    let m = msg(g.weight("w3", &[3, 48], DType::Q4_0, vec![0u8; 54], None));
    assert!(m.contains("multiple of its block size 32"), "{m}");
    let m = msg(g.weight("w4", &[], DType::Q4_K, vec![0u8; 144], None));
    assert!(m.contains("block size 256"), "{m}");
    // Element strides that would wrap are refused even when the byte count fits.
    let m = msg(g.weight("w5", &[1 << 58, 256], DType::Q6_K, Vec::<u8>::new(), None));
    assert!(m.contains("too large"), "{m}");
}

#[test]
fn quantized_tensors_are_weights_only() {
    let mut g = Graph::new();
    assert!(msg(g.input("x", &[2, 32], DType::Q8_0)).contains("quantized tensors are weights"));
    assert!(msg(g.persistent("kv", &[2, 32], DType::Q8_0)).contains("cannot be q8_0"));
    let w = q4_0_weight(&mut g, "w", &[2, 32]);
    assert!(msg(g.output("out", w)).contains("output `out` cannot be q4_0"));
    assert!(msg(g.cpy(w, DType::F32)).contains("cpy"));
    let x = g.input("f", &[2, 32], DType::F32).unwrap();
    assert!(msg(g.cpy(x, DType::Q4_0)).contains("cpy"));
    assert!(msg(g.concat(w, w, 0)).contains("concat"));
    assert!(msg(g.add(x, w)).contains("float"));
    assert!(msg(g.rms_norm(w, 1e-5)).contains("float"));
}

#[test]
fn quantized_views_keep_rows_whole() {
    let mut g = Graph::new();
    let w = q4_0_weight(&mut g, "w", &[4, 6, 64]);
    // Transposes, reshapes of leading axes and row slices keep rows whole.
    assert!(g.transpose(w, 1, 2).is_ok());
    let flat = g.reshape(w, &[24, 64]).unwrap();
    let rows = g.slice(flat, 0, 3, 9).unwrap();
    assert_eq!(g.tensor(rows).layout.offset, 3 * 64);
    assert!(g.slice(w, 1, 1, 2).is_ok());
    // Splitting a row is refused, whatever the view.
    assert!(msg(g.slice(w, 2, 0, 32)).contains("rows of 64 elements whole"));
    assert!(msg(g.reshape(w, &[48, 32])).contains("rows of 64 elements whole"));
    assert!(msg(g.reshape(w, &[4, 6, 2, 32])).contains("whole"));
}

#[test]
fn quantized_weights_are_read_as_x_at_w_t_and_as_tables() {
    let mut g = Graph::new();
    let w = q4_0_weight(&mut g, "w", &[10, 64]);
    let x = g.input("x", &[3, 64], DType::F32).unwrap();
    let wt = g.transpose(w, 0, 1).unwrap();
    let y = g.mul_mat(x, wt).unwrap();
    assert_eq!(g.tensor(y).shape(), &[3, 10]);
    assert_eq!(g.tensor(y).dtype, DType::F32);
    // Blocks along the output axis, or the weight on the left: refused.
    let x10 = g.input("x10", &[3, 10], DType::F32).unwrap();
    assert!(msg(g.mul_mat(x10, w)).contains("blocks along axis -2"));
    let xt = g.input("xt", &[64, 3], DType::F32).unwrap();
    assert!(msg(g.mul_mat(w, xt)).contains("a must be a float tensor"));
    let ids = g.input("ids", &[2], DType::I32).unwrap();
    let rows = g.get_rows(w, ids).unwrap();
    assert_eq!(g.tensor(rows).shape(), &[2, 64]);
    assert!(msg(g.get_rows(wt, ids)).contains("its rows"));
    // MoE experts [E, n, k] read as [E, k, n].
    let e = q4_0_weight(&mut g, "experts", &[4, 8, 64]);
    let et = g.transpose(e, 1, 2).unwrap();
    let sel = g.input("sel", &[3, 2], DType::I32).unwrap();
    let sw = g.input("sw", &[3, 2], DType::F32).unwrap();
    let out = g.mul_mat_id(et, x, sel, sw).unwrap();
    assert_eq!(g.tensor(out).shape(), &[3, 8]);
    assert!(Op::MulMat.accepts(DType::F32, &[DType::F32, DType::Q4_0]));
}
