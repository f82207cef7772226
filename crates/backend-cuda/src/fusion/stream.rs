//! Weight streaming: the decode products on quantized weights ask later launches' weights into
//! L2 ahead of their use (`CudaConfig::q_stream_mb`, tune key `gemv_q_stream_mb`).
//!
//! Why: a decode step is a chain of dependent launches, and only some of them read many
//! weight bytes (gate/up, down, the head). While the attention and the latency-bound products
//! (q/k/v, o) run, the device's memory idles; the products that follow then meet their
//! weights in DRAM and read them in a few bursts at well under the read rate. If each launch
//! asks for the weights of the launches after it, those reads run beside the latency-bound
//! work and the later products find their bytes in L2.
//!
//! Strategy: the step's `fused_gemv1_q` launches, in plan order, read their weights as one
//! stream of bytes (each launch's weight rows, segment after segment). Each launch asks for the
//! part of the stream from the end of its own weights up to `budget` bytes past it that no
//! earlier launch asked for (`schedule`), so at any time about `budget` bytes are on their way
//! or waiting in L2. The stream is cyclic: the last launches of a step ask for the first ones'
//! weights of the next step (decode replays the same graph). The ranges go to the kernel in
//! `FgSet::pfp` (`fq_stream` in gemv.cu: bulk prefetches before the dependency wait, never
//! waited for), so a prefetch changes no result. A model whose quantized weights all fit in the
//! budget streams nothing: they stay in L2 anyway.

use crate::exec::launch::{quant_row_bytes, Exec};
use crate::fusion::gemv::PF_RANGES;
use crate::fusion::group::{Kind, Nodes};

/// The weight byte ranges (address, length) step `kind` reads through `fused_gemv1_q`: a
/// one-row product group or head on quantized weights that live in a weights buffer (read
/// ahead of the dependency wait is then allowed); `None` for any other step.
pub(super) fn reads(exec: &Exec<'_>, nodes: &Nodes<'_>, kind: &Kind) -> Option<Vec<(u64, u64)>> {
    let mms: Vec<usize> = match kind {
        Kind::Gemv { segs, .. } => segs.iter().map(|s| s.mm).collect(),
        Kind::HeadArgmax { mm, .. } if exec.inner.cfg.q_head => vec![*mm],
        _ => return None,
    };
    let mut out = Vec::with_capacity(mms.len());
    for mm in mms {
        let node = &nodes[mm];
        let (a, w) = (node.srcs.first()?, node.srcs.get(1)?);
        let one_row = a.shape.len() == 2 && a.shape[0] == 1;
        if !one_row || !w.dtype.is_quantized() || !exec.inner.bufs.is_weights(w.buffer) {
            return None;
        }
        let w = exec.resolve(w).ok()?;
        let (&n, &stride) = (w.shape.get(1)?, w.strides.get(1)?);
        let rs = quant_row_bytes(w.dtype, stride)?;
        out.push((w.ptr, u64::try_from(n.checked_mul(rs)?).ok()?));
    }
    Some(out)
}

/// What each step asks into L2, given what each step reads (`reads`; `None`: no
/// `fused_gemv1_q` launch) and the budget in bytes: see the module's strategy. Ranges are
/// trimmed to 16-byte boundaries (the bulk prefetch's alignment), adjacent ones merged, at
/// most `PF_RANGES` a step (the rest of its part is left to the launches' own loads).
pub(super) fn schedule(reads: &[Option<Vec<(u64, u64)>>], budget: u64) -> Vec<Vec<(u64, u64)>> {
    let mut out = vec![Vec::new(); reads.len()];
    // The stream: every launch's ranges in order, with each range's start in the stream.
    let launches: Vec<(usize, &[(u64, u64)])> = reads
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_deref().map(|r| (i, r)))
        .collect();
    let mut flat = Vec::new();
    let mut ends = Vec::with_capacity(launches.len());
    let mut total = 0u64;
    for (_, rs) in &launches {
        for &(p, n) in *rs {
            flat.push((total, p, n));
            total += n;
        }
        ends.push(total);
    }
    if launches.is_empty() || budget == 0 || total <= budget {
        return out;
    }
    for (k, &(step, _)) in launches.iter().enumerate() {
        // What the launch before asked for ends at its end plus the budget (cyclic).
        let prev = match k {
            0 => ends[launches.len() - 1] + budget - total,
            _ => ends[k - 1] + budget,
        };
        let (from, to) = (ends[k].max(prev), ends[k] + budget);
        out[step] = ranges(&flat, total, from, to);
    }
    out
}

/// The address ranges of stream positions [from, to) (taken modulo `total`; to - from <=
/// total), 16-byte trimmed, merged where contiguous, at most `PF_RANGES`.
fn ranges(flat: &[(u64, u64, u64)], total: u64, from: u64, to: u64) -> Vec<(u64, u64)> {
    let mut pieces = Vec::new();
    let (a, b) = (from % total, from % total + (to - from));
    let spans = if b <= total {
        vec![(a, b)]
    } else {
        vec![(a, total), (0, b - total)]
    };
    for (a, b) in spans {
        for &(s, p, n) in flat {
            let (lo, hi) = (a.max(s), b.min(s + n));
            if lo < hi {
                pieces.push((p + (lo - s), hi - lo));
            }
        }
    }
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (p, n) in pieces {
        match merged.last_mut() {
            Some(last) if last.0 + last.1 == p => last.1 += n,
            _ => merged.push((p, n)),
        }
    }
    merged
        .into_iter()
        .filter_map(|(p, n)| {
            let (start, end) = (p.next_multiple_of(16), (p + n) & !15);
            (start < end).then(|| (start, end - start))
        })
        .take(PF_RANGES)
        .collect()
}

/// The budget in bytes under `exec`'s settings (0: no streaming).
pub(super) fn budget(exec: &Exec<'_>) -> u64 {
    exec.inner.cfg.q_stream_mb as u64 * (1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_launch_asks_for_the_next_budget_of_the_stream_once() {
        // Three launches reading 100, 300 (two ranges) and 200 bytes; budget 160.
        let reads = vec![
            Some(vec![(0x1000, 96)]),
            None,
            Some(vec![(0x2000, 160), (0x3000, 144)]),
            Some(vec![(0x4000, 208)]),
        ];
        let total = 96 + 160 + 144 + 208;
        let got = schedule(&reads, 160);
        assert!(
            got[1].is_empty(),
            "a step without a launch asks for nothing"
        );
        // Launch 2 (stream 400..608) asks for 608..768: the next step's 0..160, launch 0's
        // weights and launch 1's first 64 bytes.
        assert_eq!(got[3], vec![(0x1000, 96), (0x2000, 64)]);
        // Launch 0 (0..96): up to 256, from where launch 2 stopped: launch 1's next 96 bytes.
        assert_eq!(got[0], vec![(0x2000 + 64, 96)]);
        // Launch 1 (96..400) reads 144 of its own bytes that nobody asked for (its weights pass
        // the budget), and asks for 400..560; launch 2 reads its last 48 bytes itself.
        assert_eq!(got[2], vec![(0x4000, 160)]);
        let asked: u64 = got.iter().flatten().map(|r| r.1).sum();
        assert_eq!(asked, total - 144 - 48);
    }

    #[test]
    fn a_stream_inside_the_budget_is_not_streamed() {
        let reads = vec![Some(vec![(0x1000, 4096)]), Some(vec![(0x9000, 4096)])];
        assert!(schedule(&reads, 8192).iter().all(Vec::is_empty));
        assert!(schedule(&reads, 0).iter().all(Vec::is_empty));
        assert!(schedule(&[None, None], 16).iter().all(Vec::is_empty));
    }

    #[test]
    fn ranges_are_trimmed_to_16_bytes_merged_and_capped() {
        // Contiguous tensors merge; an odd start and end are trimmed inward.
        let flat = [(0, 0x1003, 100), (100, 0x1067, 61), (161, 0x5000, 32)];
        assert_eq!(
            ranges(&flat, 193, 0, 193),
            vec![(0x1010, 0x90), (0x5000, 32)]
        );
        // More pieces than `PF_RANGES`: the first ones.
        let flat: Vec<(u64, u64, u64)> = (0..8).map(|i| (i * 64, 0x10000 * (i + 1), 64)).collect();
        let got = ranges(&flat, 512, 0, 512);
        assert_eq!(got.len(), PF_RANGES);
        assert_eq!(got[0], (0x10000, 64));
    }
}
