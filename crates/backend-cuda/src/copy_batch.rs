//! The copy batch: small copies that wait to run together as one kernel launch.
//!
//! Why: between two decode graphs the host writes a few bytes (token id, position, KV slot,
//! mask row) and reads one token back. On a copy engine each of those is a DMA with its own
//! latency, and the next graph waits behind them; as one kernel whose parameters carry the host
//! bytes, they cost one launch and no copy engine runs between the graphs.
//!
//! Strategy: a [`Batch`] packs up to [`BATCH_ITEMS`] copies into one [`BatchParams`] — host
//! bytes inline (each 16-byte aligned, [`BATCH_DATA`] in all), device-to-device and
//! device-to-host items as addresses — the one by-value parameter of `copy_batch`
//! (kernels/elementwise.cu). The ticket stream owns the batch and launches it before whatever
//! reaches its driver next (`TicketStream::defer_htod` and kin), so stream order is call order.
//!
//! Invariants: [`BatchParams`] has the layout the kernel reads (4,048 bytes, under every
//! device's 4 KiB of kernel parameters; checked by a test); a pushed copy always fits (the
//! caller asks [`Batch::fits`] first); after a launch the batch is empty again.

/// Most copies one batch carries.
pub const BATCH_ITEMS: usize = 8;
/// Bytes of host data one batch carries inside its kernel parameters. With the items the
/// parameter block is 4,048 bytes: every CUDA device takes 4 KiB of kernel parameters.
pub const BATCH_DATA: usize = 3840;

/// One copy of a batch: `len` bytes to `dst`, from device address `src`, or (`src == 0`) from
/// the batch's own data at `at`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchItem {
    pub dst: u64,
    pub src: u64,
    pub len: u32,
    pub at: u32,
}

/// The one parameter of the `copy_batch` kernel (layout shared with `CopyBatch` in
/// elementwise.cu): the host bytes first, so that they start 16-byte aligned.
#[repr(C, align(16))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchParams {
    pub data: [u8; BATCH_DATA],
    pub items: [BatchItem; BATCH_ITEMS],
    pub n: u32,
    pub pad: u32,
}

impl Default for BatchParams {
    fn default() -> Self {
        BatchParams {
            data: [0; BATCH_DATA],
            items: [BatchItem::default(); BATCH_ITEMS],
            n: 0,
            pad: 0,
        }
    }
}

/// Small copies waiting to run together as one launch of `kernel` (`F`: a loaded function).
pub(crate) struct Batch<F> {
    /// The `copy_batch` kernel; `None`: batching is off.
    kernel: Option<F>,
    params: Box<BatchParams>,
    /// Bytes of `params.data` in use (each copy's data starts 16-byte aligned).
    used: usize,
    /// The pending batch holds a read.
    has_read: bool,
}

impl<F: Copy> Batch<F> {
    /// An empty batch with batching off.
    pub(crate) fn new() -> Self {
        Batch {
            kernel: None,
            params: Box::default(),
            used: 0,
            has_read: false,
        }
    }

    /// Turns batching on: pending copies run as launches of `kernel`.
    pub(crate) fn enable(&mut self, kernel: F) {
        self.kernel = Some(kernel);
    }

    /// Whether batching is on.
    pub(crate) fn enabled(&self) -> bool {
        self.kernel.is_some()
    }

    /// Whether one more copy carrying `data_len` host bytes fits.
    pub(crate) fn fits(&self, data_len: usize) -> bool {
        (self.params.n as usize) < BATCH_ITEMS && self.used + data_len <= BATCH_DATA
    }

    /// Appends a copy of `len` bytes to `dst`: `data` (host bytes, `src == 0`) or from `src`
    /// (`read`: into host memory). The caller checked [`Batch::fits`].
    pub(crate) fn push(&mut self, dst: u64, src: u64, data: &[u8], len: usize, read: bool) {
        let at = self.used;
        self.params.data[at..at + data.len()].copy_from_slice(data);
        self.used = (at + data.len()).next_multiple_of(16);
        let n = self.params.n as usize;
        self.params.items[n] = BatchItem {
            dst,
            src,
            len: len as u32,
            at: at as u32,
        };
        self.params.n += 1;
        self.has_read |= read;
    }

    /// The kernel to launch, when batching is on and copies are pending.
    pub(crate) fn launchable(&self) -> Option<F> {
        self.kernel.filter(|_| self.params.n > 0)
    }

    /// Whether a pending copy is a read (its launch is followed by the read event).
    pub(crate) fn has_read(&self) -> bool {
        self.has_read
    }

    /// The parameter block, for the launch (the driver copies it at the launch).
    pub(crate) fn params_ptr(&mut self) -> *mut BatchParams {
        &mut *self.params
    }

    /// Forgets the pending copies (after their launch, or its failure).
    pub(crate) fn clear(&mut self) {
        self.params.n = 0;
        self.used = 0;
        self.has_read = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against `CopyBatch` and `BatchItem` as elementwise.cu declares them (the source the
    /// kernel is compiled from): every field at the same offset, the same size and alignment,
    /// the same bounds; and within the 4 KiB of parameters every device accepts.
    #[test]
    fn the_batch_parameters_have_the_layout_the_kernel_reads() {
        use crate::abi::{c_define, c_struct};
        use std::mem::{align_of, offset_of, size_of};
        let src = include_str!("../kernels/elementwise.cu");
        assert_eq!(c_define(src, "BATCH_ITEMS"), BATCH_ITEMS);
        assert_eq!(c_define(src, "BATCH_DATA"), BATCH_DATA);
        let item = c_struct(src, "BatchItem");
        assert_eq!(item.names(), ["dst", "src", "len", "at"]);
        let host = [
            offset_of!(BatchItem, dst),
            offset_of!(BatchItem, src),
            offset_of!(BatchItem, len),
            offset_of!(BatchItem, at),
        ];
        assert_eq!(
            item.fields.iter().map(|f| f.offset).collect::<Vec<_>>(),
            host
        );
        assert_eq!(
            (item.size, item.align),
            (size_of::<BatchItem>(), align_of::<BatchItem>())
        );
        let batch = c_struct(src, "CopyBatch");
        assert_eq!(batch.names(), ["data", "items", "n", "pad"]);
        let host = [
            offset_of!(BatchParams, data),
            offset_of!(BatchParams, items),
            offset_of!(BatchParams, n),
            offset_of!(BatchParams, pad),
        ];
        assert_eq!(
            batch.fields.iter().map(|f| f.offset).collect::<Vec<_>>(),
            host
        );
        assert_eq!(
            (batch.size, batch.align),
            (size_of::<BatchParams>(), align_of::<BatchParams>())
        );
        assert!(
            size_of::<BatchParams>() <= 4096,
            "kernel parameters are at most 4 KiB"
        );
    }

    #[test]
    fn host_bytes_start_aligned_and_a_full_batch_takes_no_more() {
        let mut b: Batch<()> = Batch::new();
        assert!(!b.enabled() && b.launchable().is_none());
        b.enable(());
        assert!(b.launchable().is_none(), "nothing pending");
        b.push(100, 0, &[1, 2, 3], 3, false);
        b.push(200, 0, &[4; 20], 20, false);
        b.push(300, 7, &[], 8, true);
        assert_eq!(b.launchable(), Some(()));
        assert!(b.has_read());
        // SAFETY: the box lives as long as `b`, and nothing writes it while `p` is read.
        let p = unsafe { &*b.params_ptr() };
        assert_eq!((p.items[0].at, p.items[1].at), (0, 16));
        assert_eq!(&p.data[16..36], &[4; 20]);
        assert_eq!(
            p.items[2],
            BatchItem {
                dst: 300,
                src: 7,
                len: 8,
                at: 48
            }
        );
        assert!(!b.fits(BATCH_DATA - 47), "data past the end");
        assert!(b.fits(BATCH_DATA - 48));
        for i in 3..BATCH_ITEMS {
            b.push(i as u64, 9, &[], 4, false);
        }
        assert!(!b.fits(0), "every item taken");
        b.clear();
        assert!(b.launchable().is_none() && !b.has_read() && b.fits(BATCH_DATA));
    }
}
