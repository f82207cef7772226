//! lowsync bindings (being written).
