//! The node's persistent identity: an ed25519 key in a file readable by its owner only, so a
//! peer keeps its PeerId across restarts. The file is locked while a process uses it: two
//! processes with one identity would be one peer to the network, and neither would see the
//! other.

use anyhow::{Context, bail};
use libp2p::identity::Keypair;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where the key lives when `--identity` is not given.
pub fn default_path() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".shoal").join("identity.key"),
        None => PathBuf::from("shoal-identity.key"),
    }
}

/// A loaded identity, and the lock that keeps other processes from using it at the same time
/// (released when this is dropped, or when the process exits however it exits).
#[derive(Debug)]
pub struct Identity {
    /// The key.
    pub key: Keypair,
    _lock: File,
}

/// Loads the key at `path`, creating it if it does not exist (readable by its owner only,
/// written atomically, never over an existing file), and locks it for this process. A link is
/// not followed (someone else could point it anywhere); a key readable by others is used, with
/// a warning.
pub fn load_or_create(path: &Path) -> anyhow::Result<Identity> {
    let file = match open_no_follow(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create directory {}", dir.display()))?;
            }
            let key = Keypair::generate_ed25519();
            match shoal_compute::file::create_owner_only(path, &key.to_protobuf_encoding()?) {
                Ok(()) => {}
                // Another process created it meanwhile: use that one.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("cannot write identity file {}", path.display()));
                }
            }
            open_no_follow(path)
                .with_context(|| format!("cannot read identity file {}", path.display()))?
        }
        Err(e) => {
            return Err(e).with_context(|| format!("cannot read identity file {}", path.display()));
        }
    };
    lock(&file, path)?;
    warn_if_loose(&file, path);
    let mut bytes = Vec::new();
    (&file)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read identity file {}", path.display()))?;
    let key = Keypair::from_protobuf_encoding(&bytes)
        .with_context(|| format!("identity file {} is not a shoal key", path.display()))?;
    Ok(Identity { key, _lock: file })
}

fn open_no_follow(path: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NOFOLLOW);
    options.open(path).map_err(|e| {
        // O_NOFOLLOW on a link fails with ELOOP: say what it is.
        if path.is_symlink() {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it is a symbolic link, which an identity file must not be",
            )
        } else {
            e
        }
    })
}

/// Takes the file's exclusive advisory lock (`flock`), without waiting. The kernel releases
/// it when the process exits, however it exits.
#[cfg(unix)]
fn lock(file: &File, path: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `flock` on a file descriptor this `File` owns and keeps open; no memory is
    // passed.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if locked == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        bail!(
            "identity file {} is in use by another shoal process; give every process on this \
             machine its own with --identity FILE",
            path.display()
        );
    }
    Err(e).with_context(|| format!("cannot lock identity file {}", path.display()))
}

/// No advisory locks here: two processes with one identity are not caught on this platform.
#[cfg(not(unix))]
fn lock(_file: &File, _path: &Path) -> anyhow::Result<()> {
    Ok(())
}

/// Warns (once, on the log) about a key others can read or write.
fn warn_if_loose(file: &File, path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = file.metadata() {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(
                    "identity file {} can be read or written by others (mode {mode:o}); \
                     `chmod 600 {}` keeps this peer's identity its own",
                    path.display(),
                    path.display()
                );
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("shoal-id-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn identity_persists_and_is_private() {
        let dir = dir("persist");
        let path = dir.join("id.key");
        let a = load_or_create(&path).unwrap().key.public().to_peer_id();
        let b = load_or_create(&path).unwrap().key.public().to_peer_id();
        assert_eq!(a, b);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(&path, b"garbage").unwrap();
        assert!(load_or_create(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn an_identity_in_use_is_refused_until_it_is_released() {
        let dir = dir("lock");
        let path = dir.join("id.key");
        let held = load_or_create(&path).unwrap();
        let e = load_or_create(&path).unwrap_err().to_string();
        assert!(e.contains("in use") && e.contains("--identity"), "{e}");
        drop(held);
        load_or_create(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_link_is_not_followed() {
        let dir = dir("link");
        let real = dir.join("real.key");
        load_or_create(&real).unwrap();
        let link = dir.join("link.key");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = format!("{:#}", load_or_create(&link).unwrap_err());
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
