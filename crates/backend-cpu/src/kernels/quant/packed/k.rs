//! Packed groups of the K block types (Q4_K, Q6_K): see `super`.

use lowsync_graph::DType;

use super::PackedType;

/// The packed layout of `dt`, if this file has one.
pub(super) fn lookup(dt: DType) -> Option<&'static PackedType> {
    let _ = dt;
    None
}
