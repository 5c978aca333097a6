//! The node's persistent identity: an ed25519 key in a file readable by its owner only, so a
//! peer keeps its PeerId across restarts.

use anyhow::Context;
use libp2p::identity::Keypair;
use std::path::{Path, PathBuf};

/// Where the key lives when `--identity` is not given.
pub fn default_path() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".shoal").join("identity.key"),
        None => PathBuf::from("shoal-identity.key"),
    }
}

/// Loads the key at `path`, creating it (readable by its owner only, written atomically) if it
/// does not exist.
pub fn load_or_create(path: &Path) -> anyhow::Result<Keypair> {
    match std::fs::read(path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes)
            .with_context(|| format!("identity file {} is not a shoal key", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            write_private(path, &key.to_protobuf_encoding()?)?;
            Ok(key)
        }
        Err(e) => Err(e).with_context(|| format!("cannot read identity file {}", path.display())),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create directory {}", dir.display()))?;
    }
    shoal_compute::write_owner_only(path, bytes)
        .with_context(|| format!("cannot write identity file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_persists_and_is_private() {
        let dir = std::env::temp_dir().join(format!("shoal-id-{}", std::process::id()));
        let path = dir.join("id.key");
        let a = load_or_create(&path).unwrap();
        let b = load_or_create(&path).unwrap();
        assert_eq!(a.public().to_peer_id(), b.public().to_peer_id());
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
}
