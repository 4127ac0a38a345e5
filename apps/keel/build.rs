//! Compiles the shipping service's protobuf with protox, a protobuf
//! compiler written in Rust: no system `protoc`, so a fresh machine builds
//! `keel` with cargo alone.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/shipping/v1/shipping.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("shipping_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
