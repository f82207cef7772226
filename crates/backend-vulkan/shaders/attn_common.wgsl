// What the fused decode attentions share (`attn_body.wgsl`, `attn_body_v.wgsl`,
// `attn_split_g.wgsl`): the push constants, the workgroup size and chunk, the shared arrays,
// the subgroup-first reductions, the early query load, the mask test, the span scan and the
// chunk bounds.
//
// Why: one copy of the span and chunk arithmetic keeps every attention kernel's keys the same.

struct Pc {
    // heads, head dim, keys (the window), query heads per kv head
    shape: vec4<u32>,
    // out: head stride, dim stride, offset
    d_str: vec4<u32>,
    // q: head stride, dim stride, offset
    a_str: vec4<u32>,
    // K: kv-head stride, dim stride, key stride, offset
    b_str: vec4<u32>,
    // V: kv-head stride, key stride, dim stride, offset
    offs: vec4<u32>,
    // mask: head stride (0 when broadcast), key stride, offset; `attn_split`: partials offset
    op: vec4<u32>,
    // f32 bits: scale; `attn_split`: the most chunks a head takes, the fewest keys a chunk takes
    prm: vec4<u32>,
}
var<immediate> pc: Pc;

const WG: u32 = 256u;
const CH: u32 = 512u;
// Threads per key in the scores, and keys per pass (WG / P).
const P: u32 = 4u;
const KB: u32 = 64u;
const NINF_BITS: u32 = 0xff800000u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> sc: array<f32, 512>;
var<workgroup> part: array<f32, 256>;

// This invocation's subgroup lane, its subgroup and the workgroup's subgroup count: set by the
// entry point (`sg_begin`) before anything here runs.
var<private> sg_lane: u32;
var<private> sg_id: u32;
var<private> sg_count: u32;

// One value per subgroup (at most WG of them).
var<workgroup> sg_part: array<f32, 256>;

fn sg_begin(lane: u32, sg: u32, nsg: u32) {
    sg_lane = lane;
    sg_id = sg;
    sg_count = nsg;
}

// The reductions go through the subgroups first (`subgroupMax`/`subgroupAdd`), then through
// one shared slot per subgroup: two barriers instead of the tree's ten. The subgroups' values
// are combined in subgroup order, so the result is the same in every invocation and run.
fn reduce_max(v: f32) -> f32 {
    let m = subgroupMax(v);
    if sg_lane == 0u {
        sg_part[sg_id] = m;
    }
    workgroupBarrier();
    var r = sg_part[0];
    for (var i = 1u; i < sg_count; i++) {
        r = max(r, sg_part[i]);
    }
    // The next reduction's writes must not overtake these reads.
    workgroupBarrier();
    return r;
}

fn reduce_sum(v: f32) -> f32 {
    let m = subgroupAdd(v);
    if sg_lane == 0u {
        sg_part[sg_id] = m;
    }
    workgroupBarrier();
    var r = sg_part[0];
    for (var i = 1u; i < sg_count; i++) {
        r += sg_part[i];
    }
    workgroupBarrier();
    return r;
}

// Element li of the query row, loaded by `query_early` (threads li < dim).
var<private> q_early: f32;

// Issues the load of query element li (threads li < dim) into `q_early`; nothing waits for it
// until `attend` or `attend_v` stores it, so a kernel calls it before its span scan and the
// two trips to memory overlap.
fn query_early(h: u32, li: u32) {
    if li < pc.shape.y {
        q_early = ld_a(pc.a_str.z + h * pc.a_str.x + li * pc.a_str.y);
    }
}

// Whether the mask admits `key` (anything but -inf).
fn admitted(m0: u32, key: u32) -> bool {
    return bitcast<u32>(ld_m(m0 + key * pc.op.y)) != NINF_BITS;
}

var<workgroup> first_key: atomic<u32>;
var<workgroup> end_key: atomic<u32>;

// The first and one past the last key of the window [0, keys) that the mask row at m0 admits,
// (0, 0) where it admits none: every thread scans a strided share (256 keys a pass), then the
// workgroup's minimum and maximum. Called by every thread (it has barriers).
fn admitted_span(m0: u32, keys: u32, li: u32) -> vec2<u32> {
    if li == 0u {
        atomicStore(&first_key, 0xffffffffu);
        atomicStore(&end_key, 0u);
    }
    workgroupBarrier();
    var f = 0xffffffffu;
    var l = 0u;
    for (var j = li; j < keys; j += WG) {
        if admitted(m0, j) {
            f = min(f, j);
            l = j + 1u;
        }
    }
    // One shared atomic per subgroup, not per invocation (they serialise on one word).
    let fs = subgroupMin(f);
    let ls = subgroupMax(l);
    if sg_lane == 0u {
        atomicMin(&first_key, fs);
        atomicMax(&end_key, ls);
    }
    workgroupBarrier();
    let kend = atomicLoad(&end_key);
    var kfirst = atomicLoad(&first_key);
    if kend == 0u {
        kfirst = 0u;
    }
    // The next call's reset must not overtake this call's reads.
    workgroupBarrier();
    return vec2<u32>(kfirst, kend);
}

// Chunk c of the span [F, L) cut into nc = clamp(ceil((L - F) / kmin), 1, cmax) chunks of
// equal length (the last shorter): (nc, first key, one past the last key). A chunk at or past
// nc is empty.
fn chunk_of(fl: vec2<u32>, c: u32, kmin: u32, cmax: u32) -> vec3<u32> {
    let span = fl.y - fl.x;
    let nc = clamp((span + kmin - 1u) / kmin, 1u, cmax);
    let per = (span + nc - 1u) / nc;
    return vec3<u32>(nc, fl.x + min(c * per, span), fl.x + min((c + 1u) * per, span));
}

