//! SyncPolicy: how a step writes its inputs and where the host waits (ARCHITECTURE §4.4).

use std::fmt;
use std::str::FromStr;

use lowsync_backend::env;

use crate::error::{Error, Result};

/// The three ways of feeding a split's user inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SyncPolicy {
    /// ggml b11434: per input, synchronize the split's backend, then a blocking write.
    Stock,
    /// #20793 "saaasg": synchronize, queue every input write asynchronously, synchronize, graph.
    Relaxed,
    /// One staged write of the packed input arena per split; no host wait until an output is
    /// read.
    #[default]
    Staged,
}

impl SyncPolicy {
    /// Every policy, in bench order.
    pub const ALL: [SyncPolicy; 3] = [SyncPolicy::Stock, SyncPolicy::Relaxed, SyncPolicy::Staged];

    /// The policy's name.
    pub const fn name(self) -> &'static str {
        match self {
            SyncPolicy::Stock => "stock",
            SyncPolicy::Relaxed => "relaxed",
            SyncPolicy::Staged => "staged",
        }
    }

    /// `LOWSYNC_SYNC_POLICY`, or `staged` when unset. A bad value is an error naming the
    /// variable.
    pub fn from_env() -> Result<Self> {
        let v = env::choice(
            "LOWSYNC_SYNC_POLICY",
            &["stock", "relaxed", "staged"],
            "stock, relaxed or staged",
        )?;
        v.map_or(Ok(SyncPolicy::Staged), str::parse)
    }
}

impl fmt::Display for SyncPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SyncPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "stock" => Ok(SyncPolicy::Stock),
            "relaxed" => Ok(SyncPolicy::Relaxed),
            "staged" => Ok(SyncPolicy::Staged),
            other => Err(Error::UnknownPolicy(other.to_string())),
        }
    }
}
