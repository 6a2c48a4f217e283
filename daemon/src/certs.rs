//! `dejavud certs`: a cluster's certificate authority and its nodes' certificates.

use std::fmt::Write as _;
use std::path::Path;

use dejavulib::net::tls::ClusterCa;
use dejavulib::net::PeerError;
use thiserror::Error;

/// Why certificates could not be issued. Nothing is written unless every check passes first.
#[derive(Debug, Error)]
pub enum CertsError {
    /// A node name that cannot go into a certificate.
    #[error("node name {0:?} is not a DNS label (lowercase letters, digits and '-', 1 to 63 characters, not starting or ending with '-')")]
    BadName(String),
    /// The same node named twice.
    #[error("node {0:?} is named twice")]
    Duplicate(String),
    /// A node certificate exists and `--force` was not given.
    #[error("{0} already exists (use --force to replace it)")]
    Exists(String),
    /// Only one of `ca.pem` and `ca.key` exists.
    #[error("{0} has ca.pem or ca.key but not both")]
    HalfAuthority(String),
    /// Generating, signing or writing failed.
    #[error(transparent)]
    Tls(#[from] PeerError),
}

fn is_dns_label(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Issues a certificate to each of `nodes` in `out`, creating the authority of `cluster` there
/// unless one exists. Returns a summary of what was written.
pub fn issue(cluster: &str, out: &Path, nodes: &[String], force: bool) -> Result<String, CertsError> {
    for (i, node) in nodes.iter().enumerate() {
        if !is_dns_label(node) {
            return Err(CertsError::BadName(node.clone()));
        }
        if nodes[..i].contains(node) {
            return Err(CertsError::Duplicate(node.clone()));
        }
        let cert = out.join(format!("{node}.pem"));
        if !force && (cert.exists() || out.join(format!("{node}.key")).exists()) {
            return Err(CertsError::Exists(cert.display().to_string()));
        }
    }
    let (has_cert, has_key) = (out.join("ca.pem").exists(), out.join("ca.key").exists());
    let mut report = String::new();
    let ca = match (has_cert, has_key) {
        (true, true) => {
            let _ = writeln!(report, "using the authority in {}", out.display());
            ClusterCa::load(out, cluster)?
        }
        (false, false) => {
            let ca = ClusterCa::generate(cluster)?;
            ca.save(out)?;
            let _ = writeln!(report, "created the authority of cluster {cluster:?} in {}", out.display());
            ca
        }
        _ => return Err(CertsError::HalfAuthority(out.display().to_string())),
    };
    for node in nodes {
        ca.issue(node)?.save(out, node)?;
        let _ = writeln!(report, "issued {node}.pem and {node}.key");
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_must_be_dns_labels() {
        for good in ["worker-0", "a", "stage3-rank1", &"x".repeat(63)] {
            assert!(is_dns_label(good), "{good}");
        }
        for bad in ["", "-a", "a-", "Worker", "a.b", "a_b", &"x".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }
}
