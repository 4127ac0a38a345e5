use super::*;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    map
}

#[test]
fn secrets_parse_and_redact() {
    let s = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    assert_eq!(s.key().len(), 24);
    assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
    assert_eq!(Secret::parse("s3cr3t").unwrap().key(), b"s3cr3t");
    assert_eq!(Secret::parse(""), Err(SecretError::Empty));
    assert_eq!(Secret::parse("whsec_"), Err(SecretError::Empty));
    assert!(matches!(
        Secret::parse("whsec_!!"),
        Err(SecretError::InvalidBase64(_))
    ));
    assert!(matches!(
        Secret::parse(&"x".repeat(MAX_SECRET_LEN + 1)),
        Err(SecretError::TooLong { .. })
    ));
    let generated = Secret::generate().unwrap();
    assert_eq!(generated.key().len(), GENERATED_KEY_BYTES);
    assert!(generated.expose().starts_with(SECRET_PREFIX));
    assert_ne!(generated, Secret::generate().unwrap());
    assert_eq!(Secret::parse(generated.expose()).unwrap(), generated);
}

#[test]
fn malformed_headers_are_refused_without_panicking() {
    let v = Verifier::new([Secret::parse("s").unwrap()]);
    let ok_sig = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("webhook-timestamp", "1"), ("webhook-signature", ok_sig)],
            "missing id",
        ),
        (
            &[("webhook-id", "a"), ("webhook-signature", ok_sig)],
            "missing ts",
        ),
        (
            &[("webhook-id", "a"), ("webhook-timestamp", "1")],
            "missing sig",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "x1"),
                ("webhook-signature", ok_sig),
            ],
            "ts",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "-1"),
                ("webhook-signature", ok_sig),
            ],
            "neg",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "99999999999999999999"),
                ("webhook-signature", ok_sig),
            ],
            "big",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", "v1"),
            ],
            "no comma",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", "v1,***"),
            ],
            "b64",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", "v1,AAAA"),
            ],
            "len",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", "v2,AAAA"),
            ],
            "no v1",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", ""),
            ],
            "empty",
        ),
        (
            &[
                ("webhook-id", "a b"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", ok_sig),
            ],
            "id",
        ),
        (
            &[
                ("webhook-id", "a"),
                ("webhook-id", "b"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", ok_sig),
            ],
            "two ids",
        ),
    ];
    for (pairs, what) in cases {
        let err = v.verify(&headers(pairs), b"{}", 1).expect_err(what);
        assert!(
            matches!(
                err,
                VerifyError::MissingHeader(_) | VerifyError::InvalidHeader { .. }
            ),
            "{what}: {err:?}"
        );
    }
    let many = [ok_sig; MAX_SIGNATURES + 1].join(" ");
    let err = v
        .verify(
            &headers(&[
                ("webhook-id", "a"),
                ("webhook-timestamp", "1"),
                ("webhook-signature", &many),
            ]),
            b"",
            1,
        )
        .unwrap_err();
    assert!(err.to_string().contains("more than 8 signatures"), "{err}");
}

#[test]
fn timestamped_hex_headers_parse() {
    let sig = "a".repeat(64);
    let ok = format!("t=100,v1={sig},v0=ignored");
    assert_eq!(
        parse_timestamped_hex(&ok, &WEBHOOK_SIGNATURE).unwrap().0,
        "100"
    );
    for bad in [
        "",
        "t=1",
        &format!("v1={sig}"),
        "t=1,v1=zz",
        "t=1,t=2,v1=00",
        "garbage",
    ] {
        assert!(
            parse_timestamped_hex(bad, &WEBHOOK_SIGNATURE).is_err(),
            "{bad:?}"
        );
    }
}
