//! The blob store `--blobs` names: where large results (the reports) live,
//! outside the database and the broker.
//!
//! - a directory (the default: `<database>.blobs` beside the SQLite file,
//!   `keel-blobs` in the working directory on PostgreSQL), enough for one
//!   process;
//! - `s3://bucket[/folder]` (feature `s3`), shared by every process of a
//!   scaled-out system, so a report one process built is served by any.
//!   Credentials, region and endpoint come from the environment as the AWS
//!   tools read them (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, `AWS_ENDPOINT`,
//!   `AWS_ALLOW_HTTP` for a test server on loopback); requests give up
//!   within seconds, not minutes, and the bucket must exist.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::local::LocalFileSystem;

/// Where blobs go, as `--blobs` said (or its default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobsAt {
    /// A local directory.
    Directory(PathBuf),
    /// An S3 bucket, and a folder in it (possibly empty).
    S3 {
        /// `s3://bucket[/folder]`.
        url: String,
    },
}

impl BlobsAt {
    /// Parses `--blobs`: `s3://bucket[/folder]`, or a directory.
    pub fn parse(value: &str) -> Result<Self, String> {
        if let Some(rest) = value.strip_prefix("s3://") {
            let bucket = rest.split('/').next().unwrap_or_default();
            if bucket.is_empty() {
                return Err(format!("`{value}` names no bucket"));
            }
            if !cfg!(feature = "s3") {
                return Err(
                    "this keel was built without the `s3` feature; rebuild with `--features s3`, \
                     or give --blobs a directory"
                        .to_owned(),
                );
            }
            return Ok(Self::S3 {
                url: value.to_owned(),
            });
        }
        if value.contains("://") {
            return Err(format!("`{value}` is neither s3://bucket nor a directory"));
        }
        Ok(Self::Directory(PathBuf::from(value)))
    }

    /// The default beside `database` (a SQLite file), or in the working
    /// directory.
    pub fn default_for(sqlite: Option<&Path>) -> Self {
        match sqlite {
            Some(db) => {
                let mut dir = db.as_os_str().to_owned();
                dir.push(".blobs");
                Self::Directory(PathBuf::from(dir))
            }
            None => Self::Directory(PathBuf::from("keel-blobs")),
        }
    }

    /// Opens the store (a directory is made if missing).
    pub fn open(&self) -> Result<Blobs, String> {
        match self {
            Self::Directory(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("blobs: cannot create `{}`: {e}", dir.display()))?;
                let store = LocalFileSystem::new_with_prefix(dir)
                    .map_err(|e| format!("blobs: `{}`: {e}", dir.display()))?;
                Ok(Blobs {
                    store: Arc::new(store),
                    local_root: Some(dir.clone()),
                })
            }
            Self::S3 { url } => Ok(Blobs {
                store: open_s3(url)?,
                local_root: None,
            }),
        }
    }
}

/// An opened blob store, which stores durably: a put is answered once the
/// object would survive a power loss.
#[derive(Debug, Clone)]
pub struct Blobs {
    store: Arc<dyn ObjectStore>,
    /// The directory of a local store: object_store renames its files into
    /// place without an fsync, so one follows each put.
    local_root: Option<PathBuf>,
}

impl Blobs {
    /// Blobs in memory (tests, the demo): nothing to survive.
    pub fn in_memory() -> Self {
        Self {
            store: Arc::new(object_store::memory::InMemory::new()),
            local_root: None,
        }
    }

    /// The store, to read, list and delete.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Stores `bytes` at `path`, durably before it returns: an S3 store's
    /// acknowledgement, or a local file and its directory fsynced.
    pub async fn put(
        &self,
        path: &object_store::path::Path,
        bytes: Vec<u8>,
    ) -> Result<(), object_store::Error> {
        self.store.put(path, bytes.into()).await?;
        let Some(root) = &self.local_root else {
            return Ok(());
        };
        let file = root.join(path.as_ref());
        tokio::task::spawn_blocking(move || fsync_with_directory(&file))
            .await
            .map_err(|e| object_store::Error::Generic {
                store: "blobs",
                source: e.into(),
            })?
            .map_err(|e| object_store::Error::Generic {
                store: "blobs",
                source: e.into(),
            })
    }
}

/// Flushes `file` and the directory entry that names it.
fn fsync_with_directory(file: &Path) -> std::io::Result<()> {
    std::fs::File::open(file)?.sync_all()?;
    match file.parent() {
        Some(dir) => std::fs::File::open(dir)?.sync_all(),
        None => Ok(()),
    }
}

#[cfg(feature = "s3")]
fn open_s3(url: &str) -> Result<Arc<dyn ObjectStore>, String> {
    let claims = keel_messaging::claim_check::ClaimCheck::s3(url, Vec::<(&str, String)>::new())
        .map_err(|e| format!("blobs: {e}"))?;
    let store = Arc::clone(claims.store());
    let folder = url
        .trim_start_matches("s3://")
        .split_once('/')
        .map(|(_, folder)| folder.trim_matches('/'))
        .unwrap_or_default();
    Ok(if folder.is_empty() {
        store
    } else {
        Arc::new(object_store::prefix::PrefixStore::new(store, folder))
    })
}

#[cfg(not(feature = "s3"))]
fn open_s3(_: &str) -> Result<Arc<dyn ObjectStore>, String> {
    Err("blobs: this keel was built without the `s3` feature".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_parse_and_default() {
        assert_eq!(
            BlobsAt::parse("/var/lib/keel/blobs").unwrap(),
            BlobsAt::Directory("/var/lib/keel/blobs".into())
        );
        assert!(BlobsAt::parse("s3://").is_err());
        assert!(BlobsAt::parse("gs://bucket").is_err());
        assert_eq!(
            BlobsAt::default_for(Some(Path::new("data/keel.db"))),
            BlobsAt::Directory("data/keel.db.blobs".into())
        );
    }
}
