//! Machine-readable reports, written atomically.

use anyhow::Context;
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// Writes `value` as pretty JSON to `path` via a temporary file and a rename, so a reader never
/// sees half a report.
pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)
        .with_context(|| format!("cannot create report {}", tmp.display()))?;
    serde_json::to_writer_pretty(&mut f, value)?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write report {}", path.display()))
}
