//! A directory whose files are as fragile as a real disk's, for crash tests
//! of a process that stores its data there (feature `faultfs`).
//!
//! The process runs with `faultfs.c` (beside this crate's sources) preloaded:
//! it keeps, beside the directory, what of each file an fsync made durable.
//! [`FaultFs::power_loss`], once the process is dead, puts exactly that back:
//! every write not yet fsynced is lost, as a power cut loses the page cache.
//! The same shim can kill the process inside its Nth fsync (the crash
//! between a commit's write and its sync, [`FaultFs::kill_at_sync`]) and fail
//! writes with `ENOSPC` while the disk is "full" ([`FaultFs::fill`]).
//!
//! The shim is built with the machine's C compiler (`cc`, or `$CC`) the
//! first time a test asks for it. Only the libc calls SQLite's unix VFS
//! makes are wrapped, so it models SQLite's files, not any program's.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The shim's source, compiled on first use.
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/faultfs/faultfs.c");

/// A watched data directory and the shim that watches it.
#[derive(Debug)]
pub struct FaultFs {
    shim: PathBuf,
    data: PathBuf,
    durable: PathBuf,
    full_flag: PathBuf,
}

impl FaultFs {
    /// A data directory `root/data`, empty, watched by the shim. `root`
    /// must exist.
    pub fn new(root: &Path) -> io::Result<Self> {
        let root = root.canonicalize()?;
        let data = root.join("data");
        let durable = root.join("data.durable");
        std::fs::create_dir_all(&data)?;
        std::fs::create_dir_all(&durable)?;
        Ok(Self {
            shim: shim()?.clone(),
            data,
            durable,
            full_flag: root.join("disk-full"),
        })
    }

    /// Where the process under test keeps its files.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// The environment that puts the process under the shim.
    pub fn env(&self) -> Vec<(OsString, OsString)> {
        vec![
            ("LD_PRELOAD".into(), self.shim.clone().into()),
            ("FAULTFS_DIR".into(), self.data.clone().into()),
            ("FAULTFS_FULL".into(), self.full_flag.clone().into()),
        ]
    }

    /// The variable that makes the process kill itself (`SIGKILL`) inside
    /// its `nth` fsync of a watched file, before that fsync made anything
    /// durable.
    pub fn kill_at_sync(nth: u64) -> (OsString, OsString) {
        ("FAULTFS_KILL_AT_SYNC".into(), nth.to_string().into())
    }

    /// Fills the disk (every write to a watched file fails with `ENOSPC`)
    /// or lets it grow again.
    pub fn fill(&self, full: bool) -> io::Result<()> {
        if full {
            std::fs::write(&self.full_flag, b"")
        } else {
            match std::fs::remove_file(&self.full_flag) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        }
    }

    /// A power loss, after the process was killed: each watched file goes
    /// back to what its last fsync made durable; a file never fsynced is
    /// gone, and a durable file deleted behind the shim's back (by a process
    /// it did not watch) comes back. Returns how many bytes were lost in
    /// all.
    pub fn power_loss(&self) -> io::Result<u64> {
        let mut lost = 0;
        for entry in std::fs::read_dir(&self.data)? {
            let path = entry?.path();
            if !self
                .durable
                .join(path.file_name().unwrap_or_default())
                .exists()
            {
                lost += std::fs::metadata(&path)?.len();
                std::fs::remove_file(&path)?;
            }
        }
        for entry in std::fs::read_dir(&self.durable)? {
            let shadow = entry?.path();
            let name = shadow.file_name().unwrap_or_default();
            // A copy the shim had not finished when the process died.
            if name.to_string_lossy().starts_with(".partial-") {
                continue;
            }
            let path = self.data.join(name);
            let size = std::fs::metadata(&path).map_or(0, |m| m.len());
            let kept = std::fs::copy(&shadow, &path)?;
            lost += size.saturating_sub(kept);
        }
        Ok(lost)
    }
}

/// The shim, compiled once per test process.
fn shim() -> io::Result<&'static PathBuf> {
    static SHIM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    SHIM.get_or_init(|| compile().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| io::Error::other(e.clone()))
}

/// Builds the shim once per version of its source: into a name of this
/// process's, then renamed to one every test process shares.
fn compile() -> io::Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let source = std::fs::read(SOURCE)?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut hasher);
    let out = std::env::temp_dir().join(format!("keel-faultfs-{:016x}.so", hasher.finish()));
    if out.exists() {
        return Ok(out);
    }
    let partial = out.with_extension(format!("{}.partial", std::process::id()));
    let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread", "-o",
        ])
        .arg(&partial)
        .arg(SOURCE)
        .arg("-ldl")
        .status()
        .map_err(|e| io::Error::other(format!("running {cc:?} to build the faultfs shim: {e}")))?;
    if !status.success() {
        return Err(io::Error::other(format!(
            "{cc:?} could not build the faultfs shim ({status})"
        )));
    }
    std::fs::rename(&partial, &out)?;
    Ok(out)
}
