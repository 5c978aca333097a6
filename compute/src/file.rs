//! Files written so that a crash never leaves half of one: checkpoints, reports, keys.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a reader sees the old file or the new one, never a
/// partial write, even across a crash. The bytes go to a temporary file in the same directory
/// (a rename is only atomic within one file system), which is synced, renamed over `path`,
/// and then the directory is synced so the rename itself is durable.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write(path, bytes, 0o644)
}

/// Creates `path` holding `bytes`, for a secret: readable and writable by its owner only from
/// its first byte on, complete or absent even across a crash, and never in place of a file
/// that exists (`AlreadyExists` then): the bytes are written to a temporary file, which is
/// then linked to `path`, an operation that fails rather than replace anything.
pub fn create_owner_only(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let (dir, name) = dir_and_name(path)?;
    let (tmp, file) = create_temp(dir, name, 0o600)?;
    let linked = write_synced(file, bytes).and_then(|()| fs::hard_link(&tmp, path));
    let _ = fs::remove_file(&tmp);
    linked?;
    sync_dir(dir)
}

fn dir_and_name(path: &Path) -> io::Result<(&Path, &std::ffi::OsStr)> {
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
    Ok((dir, name))
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let (dir, name) = dir_and_name(path)?;
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

/// Creates a fresh temporary file next to the target, under a random name. `create_new`
/// never opens what is there already (a leftover, or a file or link planted under a name
/// someone guessed), so concurrent writers never share a file. `mode`: the file's
/// permissions where the platform has them (Unix).
fn create_temp(dir: &Path, name: &std::ffi::OsStr, mode: u32) -> io::Result<(PathBuf, File)> {
    // Random per process (the standard library seeds its hasher keys from the system's
    // randomness), then distinct per attempt.
    let random = std::collections::hash_map::RandomState::new();
    for attempt in 0..1000u32 {
        let mut tmp_name = OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{:016x}.tmp", random.hash_one(attempt)));
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
