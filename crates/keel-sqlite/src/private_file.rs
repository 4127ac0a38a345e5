//! Database files readable by their owner only.
//!
//! A Keel database holds webhook secrets, idempotency records and message
//! payloads, so it is created `0600` (owner read and write) whatever the
//! process's umask. SQLite gives its `-wal` and `-shm` files the mode of
//! the database file, so they follow.

use std::io;
use std::path::Path;

/// Creates `path` empty with mode `0600` if it does not exist yet; an
/// existing file is left as it is (its mode is the operator's choice).
pub(crate) fn create_private(path: &Path) -> io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(path) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(err) => Err(err),
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_new_file_is_the_owners_only_and_an_existing_one_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        super::create_private(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        super::create_private(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
    }
}
