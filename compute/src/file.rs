//! Files written so that a crash never leaves half of one: checkpoints, reports, keys.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a reader sees the old file or the new one, never a
/// partial write, even across a crash. The bytes go to a temporary file in the same directory
/// (a rename is only atomic within one file system), which is synced, renamed over `path`,
/// and then the directory is synced so the rename itself is durable.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write(path, bytes, 0o644)
}

/// [`write_atomic`] for a secret: the file is readable and writable by its owner only, from
/// its creation on (no moment where others could read it).
pub fn write_owner_only(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write(path, bytes, 0o600)
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no file name", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let (tmp, file) = create_temp(dir, name, mode)?;
    if let Err(e) = write_synced(file, bytes).and_then(|()| fs::rename(&tmp, path)) {
        // Best effort: the write already failed, and a leftover temp file is harmless.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

fn write_synced(mut file: File, bytes: &[u8]) -> io::Result<()> {
    file.write_all(bytes)?;
    file.sync_all()
}

/// Creates a fresh temporary file next to the target. `create_new` makes concurrent writers
/// (and leftovers of a crashed one) pick distinct names instead of sharing a file.
/// `mode`: the file's permissions where the platform has them (Unix).
fn create_temp(dir: &Path, name: &std::ffi::OsStr, mode: u32) -> io::Result<(PathBuf, File)> {
    let pid = std::process::id();
    for attempt in 0..1000u32 {
        let mut tmp_name = OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{pid}.{attempt}.tmp"));
        let tmp = dir.join(tmp_name);
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, mode);
        #[cfg(not(unix))]
        let _ = mode;
        match options.open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("no free temporary name for {:?} in {}", name, dir.display()),
    ))
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Directories cannot be opened for syncing on this platform; the rename is as durable as
/// the platform makes it.
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> io::Result<()> {
    Ok(())
}
