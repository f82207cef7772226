//! Packed groups of the 32-value block types (Q4_0, Q4_1, Q8_0): see `super`.

use lowsync_graph::DType;

use super::PackedType;

/// The packed layout of `dt`, if this file has one.
pub(super) fn lookup(dt: DType) -> Option<&'static PackedType> {
    let _ = dt;
    None
}
