use super::*;

fn args() -> ServeArgs {
    ServeArgs::default()
}

#[test]
fn defaults_are_loopback_sqlite_and_the_embedded_broker() {
    let config = args().resolve().unwrap();
    assert_eq!(config.listen, DEFAULT_LISTEN.parse().unwrap());
    assert_eq!(config.database, Database::Sqlite("keel.db".into()));
    assert_eq!(config.broker, BrokerKind::Embedded("keel.db.broker".into()));
    assert!(!config.demo_faults);
}

#[test]
fn flags_win_over_the_file_which_wins_over_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.toml");
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:9999\"\ndatabase_url = \"sqlite:/tmp/from-file.db\"\ndemo_faults = true\n",
    )
    .unwrap();
    let mut a = args();
    a.config = Some(path);
    let config = a.resolve().unwrap();
    assert_eq!(config.listen, "127.0.0.1:9999".parse().unwrap());
    assert_eq!(
        config.database,
        Database::Sqlite("/tmp/from-file.db".into())
    );
    assert!(config.demo_faults);
    a.listen = Some("127.0.0.1:7777".into());
    assert_eq!(
        a.resolve().unwrap().listen,
        "127.0.0.1:7777".parse().unwrap()
    );
}

#[test]
fn the_shipping_grpc_port_comes_from_the_flag_or_the_file() {
    assert_eq!(
        args().resolve().unwrap().shipping_grpc_listen,
        "127.0.0.1:0".parse().unwrap(),
        "a free port by default, so two processes on one host do not collide"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.toml");
    std::fs::write(&path, "shipping_grpc_listen = \"127.0.0.1:50051\"\n").unwrap();
    let mut a = args();
    a.config = Some(path);
    assert_eq!(
        a.resolve().unwrap().shipping_grpc_listen,
        "127.0.0.1:50051".parse().unwrap()
    );
    a.shipping_grpc_listen = Some("127.0.0.1:50052".into());
    assert_eq!(
        a.resolve().unwrap().shipping_grpc_listen,
        "127.0.0.1:50052".parse().unwrap()
    );
    a.shipping_grpc_listen = Some("grpc.local".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("shipping-grpc-listen"), "{refused}");
}

#[test]
fn scale_out_backends_resolve_with_their_schema_and_prefix() {
    let mut a = args();
    a.database_url = Some("postgres://keel@127.0.0.1/keel".into());
    a.broker = Some("nats://127.0.0.1:4222".into());
    a.pg_schema = Some("shop".into());
    a.stream_prefix = Some("SHOP".into());
    let resolved = a.resolve();
    if cfg!(all(feature = "postgres", feature = "nats")) {
        let options = resolved.unwrap().backend_options();
        assert!(options.shareable());
        assert_eq!(options.pg_schema, "shop");
        assert_eq!(options.stream_prefix, "SHOP");
    } else {
        assert!(resolved.unwrap_err().to_string().contains("feature"));
    }
    let options = args().resolve().unwrap().backend_options();
    assert_eq!(options.pg_schema, backend::DEFAULT_PG_SCHEMA);
    assert_eq!(options.stream_prefix, backend::DEFAULT_STREAM_PREFIX);
}

#[test]
fn the_wal_relay_is_chosen_on_postgresql_only() {
    assert!(
        !args().resolve().unwrap().outbox_relay_wal,
        "the table by default"
    );
    let mut a = args();
    a.outbox_relay = Some("wal".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("postgres://"), "{refused}");
    a.outbox_relay = Some("binlog".into());
    assert!(a.resolve().unwrap_err().to_string().contains("`binlog`"));
    if cfg!(feature = "postgres") {
        a.outbox_relay = Some("wal".into());
        a.database_url = Some("postgres://keel@127.0.0.1/keel".into());
        assert!(a.resolve().unwrap().outbox_relay_wal);
    }
}

#[test]
fn the_dependencies_get_a_database_of_their_own_beside_postgresql_only() {
    assert_eq!(args().resolve().unwrap().dependencies_database, None);
    let mut a = args();
    a.dependencies_database_url = Some("postgres://keel@127.0.0.1/deps".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("dependencies-database-url"), "{refused}");
    if cfg!(feature = "postgres") {
        a.database_url = Some("postgres://keel@127.0.0.1/keel".into());
        assert_eq!(
            a.resolve().unwrap().dependencies_database.as_deref(),
            Some("postgres://keel@127.0.0.1/deps")
        );
        a.dependencies_database_url = Some("sqlite:deps.db".into());
        assert!(a.resolve().is_err(), "a SQLite file beside PostgreSQL");
        a.dependencies_database_url = Some("mysql://h/deps".into());
        let refused = a.resolve().unwrap_err().to_string();
        assert!(refused.contains("dependencies-database-url"), "{refused}");
    }
}

#[test]
fn unusable_settings_say_what_to_change() {
    let mut a = args();
    a.listen = Some("localhost".into());
    assert!(a.resolve().unwrap_err().to_string().contains("IP:PORT"));
    let mut a = args();
    a.database_url = Some("mysql://x".into());
    assert!(a.resolve().is_err());
    let mut a = args();
    a.broker = Some("pulsar://127.0.0.1:6650".into());
    assert!(a.resolve().unwrap_err().to_string().contains("nats://"));
    let mut a = args();
    a.listen = Some("192.0.2.1:8080".into());
    assert!(a.resolve().unwrap_err().to_string().contains("admin-token"));
    a.admin_token = Some("a-long-enough-admin-token".into());
    assert!(a.resolve().is_ok());
    let mut a = args();
    a.cursor_key = Some("short".into());
    assert!(a.resolve().is_err());
}

#[test]
fn security_settings_are_checked_and_secrets_come_from_files() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "a-token-from-a-file-0123\n").unwrap();
    let mut a = args();
    a.listen = Some("192.0.2.1:8080".into());
    a.admin_token_file = Some(token_file);
    let config = a.resolve().unwrap();
    assert_eq!(
        config.admin_token.as_deref(),
        Some("a-token-from-a-file-0123")
    );
    let refused = |change: fn(&mut ServeArgs), setting: &str| {
        let mut a = args();
        change(&mut a);
        let err = a.resolve().unwrap_err().to_string();
        assert!(err.contains(setting), "{setting}: {err}");
    };
    refused(|a| a.api_keys = vec!["acme".into()], "api-key");
    refused(|a| a.api_keys = vec!["acme:short".into()], "api-key");
    refused(|a| a.secrets_key = Some("not-a-key".into()), "secrets-key");
    refused(
        |a| a.allowed_hosts = vec!["bad host".into()],
        "allowed-hosts",
    );
    refused(|a| a.max_connections = Some(0), "max_connections");
    refused(
        |a| a.max_streams_per_client = Some(0),
        "max-streams-per-client",
    );
    refused(
        |a| a.admin_token_file = Some("/nonexistent/token".into()),
        "admin-token-file",
    );
    let mut a = args();
    a.api_keys = vec!["acme:acme-key-0123456789".into()];
    a.allowed_hosts = vec!["shop.example:8443".into()];
    let config = a.resolve().unwrap();
    assert_eq!(config.api_keys.tenants().count(), 1);
    assert!(config.allowed_hosts.allows("shop.example:8443"));
    assert!(!config.secrets.is_sealing());
    assert!(!config.public_metrics);
    a.admin_token = Some("a-secret-admin-token-0123".into());
    let shown = format!("{:?}", a.resolve().unwrap());
    assert!(
        !shown.contains("a-secret-admin-token") && !shown.contains("acme-key"),
        "{shown}"
    );
}

#[test]
fn telemetry_comes_from_the_flags_or_the_file_and_bad_values_are_refused() {
    let off = format!("{:?}", args().telemetry().unwrap());
    assert!(off.contains("format: Text"), "{off}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.toml");
    std::fs::write(
        &path,
        "otlp_endpoint = \"http://collector:4317\"\notlp_protocol = \"grpc\"\nlog_format = \"json\"\n",
    )
    .unwrap();
    let mut a = args();
    a.config = Some(path);
    let on = format!("{:?}", a.telemetry().unwrap());
    for part in ["format: Json", "http://collector:4317", "Grpc", "\"keel\""] {
        assert!(on.contains(part), "{part} in {on}");
    }
    a.log_format = Some("xml".into());
    let refused = a.telemetry().unwrap_err().to_string();
    assert!(
        refused.contains("log-format") && refused.contains("json"),
        "{refused}"
    );
    a.log_format = None;
    a.otlp_protocol = Some("http/json".into());
    let refused = a.telemetry().unwrap_err().to_string();
    assert!(
        refused.contains("otlp-protocol") && refused.contains("grpc"),
        "{refused}"
    );
}

#[test]
fn a_file_the_configuration_names_is_read_only_up_to_a_bound() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'a'; 1024 * 1024 + 1]).unwrap();
    let mut a = args();
    a.config = Some(big.clone());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("larger than 1024 KiB"), "{refused}");
    let mut a = args();
    a.admin_token_file = Some("/dev/zero".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("larger than 1024 KiB"), "{refused}");
    let mut a = args();
    a.api_keys_file = Some(big);
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("api-keys-file"), "{refused}");
}

#[test]
fn a_parsed_file_resolves_like_the_file_it_came_from() {
    let file = ServeFile::from_toml("listen = \"127.0.0.1:7000\"\nmax_connections = 5\n").unwrap();
    let config = args().resolve_with(file).unwrap();
    assert_eq!(config.listen, "127.0.0.1:7000".parse().unwrap());
    let unknown = ServeFile::from_toml("listne = \"127.0.0.1:7000\"\n").unwrap_err();
    assert!(unknown.to_string().contains("listne"), "{unknown}");
}

#[test]
fn retention_runs_by_default_and_every_age_can_be_set() {
    let defaults = args().resolve().unwrap().retention;
    assert_eq!(defaults, crate::shop::retention::Retention::default());
    assert_eq!(defaults.interval, Duration::from_secs(600));
    assert!(defaults.event_log_max_age.is_some() && defaults.event_log_keep_last.is_some());

    let file = ServeFile::from_toml("event_log_keep_last = 50\njobs_grace_secs = 60\n").unwrap();
    let mut a = args();
    a.retention_interval_secs = Some(30);
    a.event_log_max_age_secs = Some(0);
    a.webhook_deliveries_max_age_secs = Some(3600);
    let retention = a.resolve_with(file).unwrap().retention;
    assert_eq!(retention.interval, Duration::from_secs(30));
    assert_eq!(retention.event_log_max_age, None, "0: no age limit");
    assert_eq!(retention.event_log_keep_last.map(|n| n.get()), Some(50));
    assert_eq!(retention.jobs_grace, Duration::from_secs(60));
    assert_eq!(retention.webhook_deliveries, Duration::from_secs(3600));

    a.retention_interval_secs = Some(0);
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("retention-interval-secs"), "{refused}");
    a.retention_interval_secs = None;
    a.inbox_retention_secs = Some(0);
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("inbox-retention-secs"), "{refused}");
}

#[test]
fn the_shipping_port_off_loopback_needs_a_credential_the_admin_token_serves() {
    let mut a = args();
    a.shipping_grpc_listen = Some("0.0.0.0:50051".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("shipping-grpc"), "{refused}");
    a.shipping_grpc_token = Some("short".into());
    let refused = a.resolve().unwrap_err().to_string();
    assert!(refused.contains("at least 16"), "{refused}");
    a.shipping_grpc_token = Some("grpc-token-grpc-token".into());
    assert_eq!(
        a.resolve().unwrap().shipping_grpc_token.as_deref(),
        Some("grpc-token-grpc-token")
    );
    let mut b = args();
    b.admin_token = Some("admin-token-admin-token".into());
    assert_eq!(
        b.resolve().unwrap().shipping_grpc_token.as_deref(),
        Some("admin-token-admin-token"),
        "the admin token by default"
    );
}

#[test]
fn every_flag_is_a_key_of_the_file_and_config_is_not() {
    use clap::CommandFactory;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    for arg in Cli::command().get_arguments() {
        let key = arg.get_id().as_str();
        let refused = ServeFile::from_toml(&format!("{key} = 1"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        if key == "config" {
            assert!(refused.contains("unknown field"), "{refused}");
        } else {
            assert!(!refused.contains("unknown field"), "{key}: {refused}");
        }
    }
}

#[test]
fn a_setting_left_out_keeps_the_files_and_a_list_given_replaces_it() {
    let file = ServeFile::from_toml(
        "demo_faults = true\nallowed_hosts = [\"a.example\"]\nmax_connections = 7\n",
    )
    .unwrap();
    let layered = args().over(&file).unwrap();
    assert!(layered.demo_faults, "a flag not given is not `false`");
    assert_eq!(layered.allowed_hosts, ["a.example"]);
    assert_eq!(layered.max_connections, Some(7));

    let mut flags = args();
    flags.allowed_hosts = vec!["b.example".to_owned()];
    flags.max_connections = Some(9);
    let layered = flags.over(&file).unwrap();
    assert_eq!(layered.allowed_hosts, ["b.example"]);
    assert_eq!(layered.max_connections, Some(9));
    assert!(layered.demo_faults);
}
