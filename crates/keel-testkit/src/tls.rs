//! Certificates a test makes for itself: a CA and the leaves it signs,
//! for TLS and mTLS over loopback without files checked in.

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};

/// A certificate authority that signs a test's certificates.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new self-signed CA with `name` as its common name.
    ///
    /// # Panics
    ///
    /// If rcgen cannot make a key or sign (it always can).
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names to check");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("a fresh key");
        let pem = params.self_signed(&key).expect("self-signed").pem();
        Self {
            issuer: Issuer::new(params, key),
            pem,
        }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A server certificate for `sans` and its key, PEM.
    pub fn server(&self, sans: Vec<SanType>) -> (String, String) {
        self.leaf(sans, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate for `sans` and its key, PEM.
    pub fn client(&self, sans: Vec<SanType>) -> (String, String) {
        self.leaf(sans, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(&self, sans: Vec<SanType>, usage: ExtendedKeyUsagePurpose) -> (String, String) {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names to check");
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("a fresh key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        (cert.pem(), key.serialize_pem())
    }
}

/// A URI name (a SPIFFE ID).
///
/// # Panics
///
/// If `name` is not ASCII.
pub fn uri(name: &str) -> SanType {
    SanType::URI(name.try_into().expect("an ASCII URI"))
}

/// A DNS name.
///
/// # Panics
///
/// If `name` is not ASCII.
pub fn dns(name: &str) -> SanType {
    SanType::DnsName(name.try_into().expect("an ASCII name"))
}
