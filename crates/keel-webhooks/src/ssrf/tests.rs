use super::*;

#[test]
fn networks_parse_and_contain() {
    let net: IpNetwork = "10.1.2.3/8".parse().unwrap();
    assert_eq!(net.to_string(), "10.0.0.0/8");
    assert!(net.contains("10.200.0.1".parse().unwrap()));
    assert!(
        net.contains("::ffff:10.0.0.1".parse().unwrap()),
        "mapped counts as v4"
    );
    assert!(!net.contains("11.0.0.1".parse().unwrap()));
    let host: IpNetwork = "::1".parse().unwrap();
    assert!(host.contains("::1".parse().unwrap()));
    assert!(!host.contains("::2".parse().unwrap()));
    let all: IpNetwork = "0.0.0.0/0".parse().unwrap();
    assert!(all.contains("8.8.8.8".parse().unwrap()));
    for bad in ["10.0.0.0/33", "::/129", "nope", "10.0.0.0/x", ""] {
        assert!(bad.parse::<IpNetwork>().is_err(), "{bad}");
    }
}

#[test]
fn public_addresses_pass() {
    for ip in [
        "8.8.8.8",
        "1.1.1.1",
        "100.63.255.255",
        "100.128.0.0",
        "172.32.0.1",
        "2606:4700::1111",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",
        "2002:808:808::1",
    ] {
        assert_eq!(forbidden_range(ip.parse().unwrap()), None, "{ip}");
    }
}
