//! The bytes of a weight: owned by the graph, or borrowed from memory someone else keeps.
//!
//! Why: a model loaded from a GGUF file is a read-only memory map; copying its tensors into
//! the graph (and again into a host backend's buffer) kept two anonymous copies of the weights
//! resident next to the file's own pages. Weight bytes are immutable once a graph holds them,
//! so one allocation (or one mapped file) can serve every graph, plan and host buffer that
//! uses them.
//!
//! Strategy: [`WeightBytes`] is a cheap, clonable handle to immutable bytes. Its owner is
//! either a `Vec`/`Arc<[u8]>` the graph took (owned), or a [`BorrowedBytes`] object that pins
//! foreign memory (e.g. a read-only numpy memory map, kept alive by a Python reference) —
//! borrowed. Host backends may read the bytes in place for as long as they hold a clone
//! ([`crate::Graph::weight`], `Backend::alias_weight`).
//!
//! Invariants: the bytes behind a handle never change and stay valid while any clone lives;
//! nothing writes through a handle.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Memory that someone else owns, pinned and immutable while this object lives.
///
/// Implementations promise that `bytes()` returns the same address and contents on every
/// call, for the object's whole life.
pub trait BorrowedBytes: Send + Sync {
    /// The pinned bytes.
    fn bytes(&self) -> &[u8];
}

#[derive(Clone)]
enum Owner {
    Vec(Arc<Vec<u8>>),
    Shared(Arc<[u8]>),
    Borrowed(Arc<dyn BorrowedBytes>),
}

/// Immutable weight bytes shared by graphs, plans and host buffers (see the module docs).
#[derive(Clone)]
pub struct WeightBytes(Owner);

impl WeightBytes {
    /// Bytes borrowed from `owner`, which keeps them valid and unchanged while it lives.
    pub fn borrowed(owner: Arc<dyn BorrowedBytes>) -> Self {
        WeightBytes(Owner::Borrowed(owner))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Owner::Vec(v) => v,
            Owner::Shared(s) => s,
            Owner::Borrowed(b) => b.bytes(),
        }
    }

    /// Whether the bytes live in memory the graph did not allocate.
    pub fn is_borrowed(&self) -> bool {
        matches!(self.0, Owner::Borrowed(_))
    }
}

impl Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl AsRef<[u8]> for WeightBytes {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

/// Takes the vector without copying it.
impl From<Vec<u8>> for WeightBytes {
    fn from(v: Vec<u8>) -> Self {
        WeightBytes(Owner::Vec(Arc::new(v)))
    }
}

impl From<Arc<[u8]>> for WeightBytes {
    fn from(s: Arc<[u8]>) -> Self {
        WeightBytes(Owner::Shared(s))
    }
}

impl fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.as_bytes();
        f.debug_struct("WeightBytes")
            .field("len", &b.len())
            .field("addr", &b.as_ptr())
            .field("borrowed", &self.is_borrowed())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Static(&'static [u8]);
    impl BorrowedBytes for Static {
        fn bytes(&self) -> &[u8] {
            self.0
        }
    }

    #[test]
    fn owned_and_borrowed_bytes_are_read_in_place() {
        let v = vec![1u8, 2, 3];
        let addr = v.as_ptr();
        let w = WeightBytes::from(v);
        assert_eq!(
            (w.as_bytes(), w.as_ptr(), w.is_borrowed()),
            (&[1u8, 2, 3][..], addr, false)
        );

        static DATA: [u8; 4] = [9, 8, 7, 6];
        let b = WeightBytes::borrowed(Arc::new(Static(&DATA)));
        let c = b.clone();
        assert!(b.is_borrowed());
        assert_eq!(b.as_ptr(), DATA.as_ptr());
        assert_eq!(c.as_ptr(), DATA.as_ptr());
        assert_eq!(&*c, &DATA[..]);
    }
}
