//! Rebuilds the crate when an embedded migration changes.

fn main() {
    // sqlx::migrate! embeds the files at compile time; rebuild when they change.
    println!("cargo:rerun-if-changed=migrations");
}
