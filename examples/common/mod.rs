//! Command-line helpers shared by the examples.
#![allow(dead_code)]

/// The value after `flag`, if present.
pub fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The number after `flag`, or `default`.
///
/// # Errors
/// If the value is not a number.
pub fn num(args: &[String], flag: &str, default: u64) -> Result<u64, std::num::ParseIntError> {
    Ok(arg(args, flag)
        .map(|v| v.parse())
        .transpose()?
        .unwrap_or(default))
}
