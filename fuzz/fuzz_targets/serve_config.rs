//! `keel serve`'s TOML configuration file: any text is refused with an error
//! or read into settings; read settings resolve, never with a panic, into a
//! configuration that holds the file's values (and the flags' over them), or
//! into an error naming what to change; and the configuration's `Debug`
//! output, which is logged, does not depend on any secret's value.
#![no_main]

use std::net::SocketAddr;

use keel::serve::{ServeArgs, ServeConfig, ServeFile};
use libfuzzer_sys::fuzz_target;

const FLAG_LISTEN: &str = "127.0.0.1:1";

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mut file) = ServeFile::from_toml(text) else {
        return;
    };
    // The files a configuration names are read from disk, not from the
    // input: keep the fuzzer off the filesystem.
    file.admin_token_file = None;
    file.api_keys_file = None;
    file.secrets_key_file = None;
    file.tls_cert = None;
    file.tls_key = None;
    let listen = file.listen.clone();
    match ServeArgs::default().resolve_with(file.clone()) {
        Ok(config) => {
            if let Some(listen) = listen {
                assert_eq!(listen.parse::<SocketAddr>().ok(), Some(config.listen));
            }
            assert_secrets_do_not_show(&config);
            let flags = ServeArgs {
                listen: Some(FLAG_LISTEN.to_owned()),
                ..ServeArgs::default()
            };
            if let Ok(flagged) = flags.resolve_with(file) {
                assert_eq!(flagged.listen, FLAG_LISTEN.parse().unwrap());
            }
        }
        Err(refusal) => assert!(!refusal.to_string().is_empty()),
    }
});

/// The `Debug` output is the same whatever the secrets' values.
fn assert_secrets_do_not_show(config: &ServeConfig) {
    let other = |secret: &Option<String>| secret.as_ref().map(|s| format!("{s}-other"));
    let mut swapped = config.clone();
    swapped.admin_token = other(&config.admin_token);
    swapped.inbound_webhook_secret = other(&config.inbound_webhook_secret);
    swapped.cursor_key = other(&config.cursor_key);
    assert_eq!(format!("{config:?}"), format!("{swapped:?}"));
}
