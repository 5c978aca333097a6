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

/// `bytes` for a person to read: "12.3 MB", "25.3 GB".
pub fn size(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.1} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}
