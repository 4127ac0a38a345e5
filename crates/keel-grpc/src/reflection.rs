//! Server reflection (`grpc.reflection.v1`), so that generic tools
//! (`grpcurl`, `grpcui`, Postman) can list and call the service without
//! its `.proto` files.

use tonic_reflection::server::v1::{ServerReflection, ServerReflectionServer};
use tonic_reflection::server::{Builder, Error};

/// The reflection service for the given encoded `FileDescriptorSet`s
/// (what `tonic-prost-build`'s `file_descriptor_set_path` or `protox`
/// writes), with the health service's own descriptors added, since
/// [`GrpcHealth`](crate::health::GrpcHealth) serves it next to yours.
pub fn reflection_service(
    descriptor_sets: &[&'static [u8]],
) -> Result<ServerReflectionServer<impl ServerReflection>, Error> {
    descriptor_sets
        .iter()
        .fold(
            Builder::configure()
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET),
            |builder, set| builder.register_encoded_file_descriptor_set(set),
        )
        .build_v1()
}
