//! What every tower middleware in the workspace writes alike.

/// Writes the three accessors tower users expect on a middleware service
/// (`get_ref`, `get_mut`, `into_inner`) for the wrapped service of type
/// `$service` held in the field `$field`. Used inside the service's
/// `impl` block: `keel_core::inner_service_accessors!(inner: S);`.
#[macro_export]
macro_rules! inner_service_accessors {
    ($field:ident : $service:ty) => {
        /// The wrapped service.
        pub fn get_ref(&self) -> &$service {
            &self.$field
        }

        /// The wrapped service, mutably.
        pub fn get_mut(&mut self) -> &mut $service {
            &mut self.$field
        }

        /// Unwraps the wrapped service; anything the middleware held for
        /// a call not yet made is dropped.
        pub fn into_inner(self) -> $service {
            self.$field
        }
    };
}
