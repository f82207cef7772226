//! Environment variables of ARCHITECTURE §8: one parser, and a bad value is an error naming
//! the variable.

use crate::{Error, Result};

/// Reads a `0`/`1` flag; unset or empty means `default`.
pub fn flag(var: &'static str, default: bool) -> Result<bool> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(v) => match v.trim() {
            "" => Ok(default),
            "0" => Ok(false),
            "1" => Ok(true),
            _ => Err(Error::Env {
                var,
                value: v,
                expected: "0 or 1",
            }),
        },
    }
}

/// Reads one of `choices`; unset or empty means `None`.
pub fn choice(
    var: &'static str,
    choices: &[&'static str],
    expected: &'static str,
) -> Result<Option<&'static str>> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => choices
            .iter()
            .find(|c| **c == v.trim())
            .map(|c| Some(*c))
            .ok_or(Error::Env {
                var,
                value: v,
                expected,
            }),
    }
}

/// Reads an unsigned integer; unset or empty means `None`.
pub fn unsigned(var: &'static str) -> Result<Option<u64>> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v.trim().parse::<u64>().map(Some).map_err(|_| Error::Env {
            var,
            value: v,
            expected: "a non-negative integer",
        }),
    }
}
