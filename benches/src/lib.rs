//! Shared graph builders for the benches (being written).
