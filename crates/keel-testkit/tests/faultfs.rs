//! The shim loses what a power cut loses, and only that: a Python process
//! (its `sqlite3` module, SQLite's unix VFS like Keel's) commits rows with
//! `synchronous = FULL`, then more with `synchronous = OFF`, and kills
//! itself; after the power loss the first rows are there and the others
//! are not. A harness that could not lose a write could not find a bug.
#![cfg(feature = "faultfs")]

use std::process::Command;

use keel_testkit::faultfs::FaultFs;

const WRITER: &str = r#"
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("PRAGMA journal_mode = WAL")
db.execute("PRAGMA synchronous = FULL")
db.execute("CREATE TABLE t (x INTEGER)")
db.commit()
for i in range(5):
    db.execute("INSERT INTO t VALUES (?)", (i,))
    db.commit()
db.execute("PRAGMA synchronous = OFF")
for i in range(5, 10):
    db.execute("INSERT INTO t VALUES (?)", (i,))
    db.commit()
os.kill(os.getpid(), 9)
"#;

const READER: &str = r#"
import sqlite3, sys
print(",".join(str(r[0]) for r in sqlite3.connect(sys.argv[1]).execute("SELECT x FROM t ORDER BY x")))
"#;

fn rows(db: &std::path::Path) -> String {
    let out = Command::new("python3")
        .args(["-c", READER])
        .arg(db)
        .output()
        .expect("python3 reads the database");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[test]
fn a_power_loss_drops_exactly_the_writes_not_fsynced() {
    let root = std::env::temp_dir().join(format!("keel-faultfs-test-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let disk = FaultFs::new(&root).expect("the shim builds");
    let db = disk.data_dir().join("t.db");
    let status = Command::new("python3")
        .args(["-c", WRITER])
        .arg(&db)
        .envs(disk.env())
        .status()
        .expect("python3 runs");
    assert!(!status.success(), "the writer kills itself");
    assert_eq!(rows(&db), "0,1,2,3,4,5,6,7,8,9", "all in the page cache");
    let lost = disk.power_loss().expect("power loss");
    assert!(lost > 0);
    assert_eq!(rows(&db), "0,1,2,3,4", "only what was fsynced survives");
    let _ = std::fs::remove_dir_all(&root);
}
