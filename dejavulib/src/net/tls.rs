//! Cluster certificates: a certificate authority per cluster, a certificate per node, and the
//! rustls configurations that accept only peers holding a certificate from that authority.
//!
//! `dejavud` generates the authority and node certificates (rcgen); every node pins the authority
//! (it is the only trust root), and both sides of a connection present a certificate: a node without
//! one, or with one from another cluster, fails the TLS handshake. QUIC always runs on these; TCP
//! uses them when TLS is turned on.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use super::error::PeerError;

/// The name every node certificate carries and every client checks.
pub const SERVER_NAME: &str = "dejavu";
/// The application protocol negotiated on TLS and QUIC connections.
pub const ALPN: &[u8] = b"dejavu/1";

fn tls_err(e: impl std::fmt::Display) -> PeerError {
    PeerError::Tls(e.to_string())
}

/// A cluster's certificate authority: it signs node certificates.
pub struct ClusterCa {
    cluster: String,
    cert_pem: String,
    key: KeyPair,
}

fn ca_params(cluster: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, format!("dejavu cluster {cluster}"));
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
}

impl ClusterCa {
    /// A new authority for the cluster named `cluster`.
    pub fn generate(cluster: &str) -> Result<Self, PeerError> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let cert = ca_params(cluster).self_signed(&key).map_err(tls_err)?;
        Ok(Self { cluster: cluster.to_owned(), cert_pem: cert.pem(), key })
    }

    /// An authority saved with [`ClusterCa::save`], to sign more node certificates.
    pub fn load(dir: &Path, cluster: &str) -> Result<Self, PeerError> {
        let cert_pem = fs::read_to_string(dir.join("ca.pem"))?;
        let key = KeyPair::from_pem(&fs::read_to_string(dir.join("ca.key"))?).map_err(tls_err)?;
        Ok(Self { cluster: cluster.to_owned(), cert_pem, key })
    }

    /// Writes `ca.pem` and `ca.key` (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), PeerError> {
        fs::create_dir_all(dir)?;
        fs::write(dir.join("ca.pem"), &self.cert_pem)?;
        write_private(&dir.join("ca.key"), &self.key.serialize_pem())
    }

    /// The authority's certificate, PEM-encoded.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for the node named `node` (a DNS-style label such as `worker-3`).
    pub fn issue(&self, node: &str) -> Result<NodeIdentity, PeerError> {
        let key = KeyPair::generate().map_err(tls_err)?;
        let mut params =
            CertificateParams::new(vec![SERVER_NAME.to_owned(), node.to_owned()]).map_err(tls_err)?;
        params.distinguished_name.push(DnType::CommonName, node);
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let issuer = Issuer::new(ca_params(&self.cluster), &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(tls_err)?;
        NodeIdentity::from_pem(&self.cert_pem, &cert.pem(), &key.serialize_pem())
    }
}

fn write_private(path: &Path, contents: &str) -> Result<(), PeerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    file.write_all(contents.as_bytes())?;
    Ok(())
}

/// A node's certificate and key, and the authority it trusts.
pub struct NodeIdentity {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
    pem: [String; 3],
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        Self {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
            pem: self.pem.clone(),
        }
    }
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity").finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// An identity from PEM text: the authority's certificate, the node's certificate, its key.
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self, PeerError> {
        Ok(Self {
            ca: CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(tls_err)?,
            cert: CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(tls_err)?,
            key: PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(tls_err)?,
            pem: [ca_pem.to_owned(), cert_pem.to_owned(), key_pem.to_owned()],
        })
    }

    /// Writes `ca.pem`, `<name>.pem` and `<name>.key` (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path, name: &str) -> Result<(), PeerError> {
        fs::create_dir_all(dir)?;
        fs::write(dir.join("ca.pem"), &self.pem[0])?;
        fs::write(dir.join(format!("{name}.pem")), &self.pem[1])?;
        write_private(&dir.join(format!("{name}.key")), &self.pem[2])
    }

    /// Reads what [`NodeIdentity::save`] wrote.
    pub fn load(dir: &Path, name: &str) -> Result<Self, PeerError> {
        let read = |file: String| fs::read_to_string(dir.join(file)).map_err(PeerError::from);
        Self::from_pem(&read("ca.pem".into())?, &read(format!("{name}.pem"))?, &read(format!("{name}.key"))?)
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, PeerError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).map_err(tls_err)?;
        Ok(Arc::new(roots))
    }

    /// TLS 1.3 server side: presents this node's certificate and requires one from the cluster.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, PeerError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .build()
            .map_err(tls_err)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls_err)?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// TLS 1.3 client side: trusts only the cluster's authority and presents this node's certificate.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, PeerError> {
        let config = self
            .client_builder()?
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())
            .map_err(tls_err)?;
        Ok(with_alpn(config))
    }

    /// A client configuration that presents no certificate (to test that servers refuse it).
    pub fn anonymous_client_config(&self) -> Result<rustls::ClientConfig, PeerError> {
        Ok(with_alpn(self.client_builder()?.with_no_client_auth()))
    }

    /// A TLS 1.3 client trusting only the cluster's authority, before its own certificate is chosen.
    fn client_builder(
        &self,
    ) -> Result<rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert>, PeerError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots()?))
    }
}

fn with_alpn(mut config: rustls::ClientConfig) -> rustls::ClientConfig {
    config.alpn_protocols = vec![ALPN.to_vec()];
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_survive_a_save_and_load() {
        let ca = ClusterCa::generate("test").unwrap();
        let node = ca.issue("worker-1").unwrap();
        let dir = tempfile::tempdir().unwrap();
        ca.save(dir.path()).unwrap();
        node.save(dir.path(), "worker-1").unwrap();
        let loaded = NodeIdentity::load(dir.path(), "worker-1").unwrap();
        assert_eq!(loaded.cert, node.cert);
        let again = ClusterCa::load(dir.path(), "test").unwrap().issue("worker-2").unwrap();
        assert_eq!(again.ca, node.ca);
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(dir.path().join("worker-1.key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(node.server_config().is_ok() && node.client_config().is_ok());
    }
}
