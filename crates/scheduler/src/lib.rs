//! lowsync-scheduler (being written).
