//! Machine-readable reports, written atomically.

use anyhow::Context;
use serde::Serialize;
use std::path::Path;

/// Writes `value` as pretty JSON to `path` atomically (see [`shoal_compute::write_atomic`]),
/// so a reader never sees half a report.
pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(value)?;
    bytes.push(b'\n');
    shoal_compute::write_atomic(path, &bytes)
        .with_context(|| format!("cannot write report {}", path.display()))
}

/// `bytes` for a person to read: "12.3 MB".
pub fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}
