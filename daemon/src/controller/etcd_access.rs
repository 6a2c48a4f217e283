//! How a controller reaches a secured etcd: TLS (the authority that signed etcd's certificates,
//! and a client certificate where etcd checks them) and etcd's own user authentication.
//!
//! Each setting is checked against the endpoints before any connection is tried, so that a
//! mismatch (an `https://` URL without an authority, an authority for plain `http://` URLs) is
//! named at start rather than found as a handshake that times out.

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use thiserror::Error;

/// Why the settings to reach etcd cannot be used.
#[derive(Debug, Error)]
pub enum EtcdAccessError {
    /// A file named by a flag cannot be read.
    #[error("cannot read {flag} {}: {source}", file.display())]
    Unreadable {
        /// The flag that names it.
        flag: &'static str,
        /// The file.
        file: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file named by a flag is empty.
    #[error("{flag} {} is empty", file.display())]
    Empty {
        /// The flag that names it.
        flag: &'static str,
        /// The file.
        file: PathBuf,
    },
    /// An `https://` endpoint, but no authority to check its certificate against.
    #[error("etcd endpoint {0} is https: give the authority that signed its certificate with --etcd-ca")]
    NoAuthority(String),
    /// An authority given, but an endpoint that is not `https://`.
    #[error(
        "--etcd-ca is given, but etcd endpoint {0} is plain http:// (with TLS, every endpoint is https://)"
    )]
    NotHttps(String),
}

/// A client certificate and its key, in PEM.
#[derive(Clone)]
pub struct ClientIdentity {
    /// The certificate chain.
    pub cert_pem: String,
    /// Its private key.
    pub key_pem: String,
}

/// What a controller needs, beyond the endpoints, to reach its etcd.
#[derive(Clone, Default)]
pub struct EtcdAccess {
    /// TLS: the PEM of the authority that signed etcd's server certificates.
    pub ca_pem: Option<String>,
    /// The controller's own certificate, for an etcd that checks its clients'
    /// (`--client-cert-auth`). Only with `ca_pem`.
    pub identity: Option<ClientIdentity>,
    /// etcd's user authentication (`auth enable`): a user and its password.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdAccess {
    // The key and the password stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("user", &self.user.as_ref().map(|(user, _)| user))
            .finish()
    }
}

/// The contents of `file`, named by `flag`, which must not be empty.
fn read(flag: &'static str, file: &Path) -> Result<String, EtcdAccessError> {
    let text = std::fs::read_to_string(file).map_err(|source| EtcdAccessError::Unreadable {
        flag,
        file: file.to_owned(),
        source,
    })?;
    if text.trim().is_empty() {
        return Err(EtcdAccessError::Empty { flag, file: file.to_owned() });
    }
    Ok(text)
}

/// Where a controller's flags say its etcd credentials are.
#[derive(Clone, Debug, Default)]
pub struct EtcdAccessFiles<'a> {
    /// `--etcd-ca`.
    pub ca: Option<&'a Path>,
    /// `--etcd-cert` and `--etcd-key`.
    pub identity: Option<(&'a Path, &'a Path)>,
    /// `--etcd-user` and `--etcd-password-file`.
    pub user: Option<(&'a str, &'a Path)>,
}

impl EtcdAccess {
    /// Reads the files `files` names and checks them against `endpoints` (an endpoint without a
    /// scheme takes the one the settings imply: https with an authority, http without).
    pub fn load(endpoints: &[String], files: &EtcdAccessFiles<'_>) -> Result<Self, EtcdAccessError> {
        for endpoint in endpoints {
            let (https, http) = (endpoint.starts_with("https://"), endpoint.starts_with("http://"));
            match files.ca {
                None if https => return Err(EtcdAccessError::NoAuthority(endpoint.clone())),
                Some(_) if http => return Err(EtcdAccessError::NotHttps(endpoint.clone())),
                _ => {}
            }
        }
        let ca_pem = files.ca.map(|file| read("--etcd-ca", file)).transpose()?;
        let identity = match files.identity {
            Some((cert, key)) => Some(ClientIdentity {
                cert_pem: read("--etcd-cert", cert)?,
                key_pem: read("--etcd-key", key)?,
            }),
            None => None,
        };
        let user = match files.user {
            Some((user, password)) => {
                let password = read("--etcd-password-file", password)?;
                Some((user.to_owned(), password.trim_end_matches(['\n', '\r']).to_owned()))
            }
            None => None,
        };
        Ok(Self { ca_pem, identity, user })
    }

    /// The client options for these settings, connections given up after `connect_timeout`.
    pub fn options(&self, connect_timeout: Duration) -> ConnectOptions {
        let mut options = ConnectOptions::new().with_connect_timeout(connect_timeout);
        if let Some(ca) = &self.ca_pem {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
            if let Some(identity) = &self.identity {
                tls = tls.identity(Identity::from_pem(&identity.cert_pem, &identity.key_pem));
            }
            options = options.with_tls(tls);
        }
        if let Some((user, password)) = &self.user {
            options = options.with_user(user, password);
        }
        options
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(urls: &[&str]) -> Vec<String> {
        urls.iter().map(|u| u.to_string()).collect()
    }

    #[test]
    fn an_https_endpoint_needs_an_authority_and_an_authority_needs_https() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let none = EtcdAccessFiles::default();
        let with_ca = EtcdAccessFiles { ca: Some(&ca), ..EtcdAccessFiles::default() };

        let e = EtcdAccess::load(&endpoints(&["https://10.0.0.1:2379"]), &none).unwrap_err();
        assert!(matches!(e, EtcdAccessError::NoAuthority(ref url) if url == "https://10.0.0.1:2379"), "{e}");
        let e = EtcdAccess::load(&endpoints(&["https://a:2379", "http://b:2379"]), &with_ca).unwrap_err();
        assert!(matches!(e, EtcdAccessError::NotHttps(ref url) if url == "http://b:2379"), "{e}");
        assert!(EtcdAccess::load(&endpoints(&["10.0.0.1:2379"]), &none).is_ok());
        assert!(EtcdAccess::load(&endpoints(&["10.0.0.1:2379"]), &with_ca).is_ok());

        let access = EtcdAccess::load(&endpoints(&["https://a:2379"]), &with_ca).unwrap();
        assert!(access.ca_pem.is_some() && access.identity.is_none() && access.user.is_none());
        assert!(EtcdAccess::load(&endpoints(&["http://a:2379"]), &none).unwrap().ca_pem.is_none());
    }

    #[test]
    fn a_missing_or_empty_credential_file_is_named_with_its_flag() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("password");
        std::fs::write(&empty, "\n").unwrap();
        let missing = dir.path().join("nowhere.pem");
        let urls = endpoints(&["http://a:2379"]);

        let files = EtcdAccessFiles { user: Some(("dejavu", &empty)), ..EtcdAccessFiles::default() };
        let e = EtcdAccess::load(&urls, &files).unwrap_err();
        assert!(matches!(e, EtcdAccessError::Empty { flag: "--etcd-password-file", .. }), "{e}");

        let https = endpoints(&["https://a:2379"]);
        let files = EtcdAccessFiles { ca: Some(&missing), ..EtcdAccessFiles::default() };
        let e = EtcdAccess::load(&https, &files).unwrap_err();
        assert!(matches!(e, EtcdAccessError::Unreadable { flag: "--etcd-ca", .. }), "{e}");
        assert!(e.to_string().contains("nowhere.pem"), "{e}");
    }

    #[test]
    fn the_password_is_read_without_its_newline_and_kept_out_of_debug_output() {
        let dir = tempfile::tempdir().unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "s3cret-pw\n").unwrap();
        let files = EtcdAccessFiles { user: Some(("dejavu", &password)), ..EtcdAccessFiles::default() };
        let access = EtcdAccess::load(&endpoints(&["http://a:2379"]), &files).unwrap();
        assert_eq!(access.user, Some(("dejavu".to_owned(), "s3cret-pw".to_owned())));
        let shown = format!("{access:?}");
        assert!(shown.contains("dejavu") && !shown.contains("s3cret"), "{shown}");
    }
}
