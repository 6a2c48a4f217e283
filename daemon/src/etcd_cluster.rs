//! A local etcd cluster on loopback, in a directory of its own: for the tests and benchmarks of
//! the controllers' high availability (`dejavud controller --etcd`), and for trying it out. Needs
//! `etcd` on the PATH (Debian's `etcd-server`). Its members are killed when it is dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The members of a local etcd cluster.
pub struct EtcdCluster {
    members: Vec<Child>,
    endpoints: String,
}

impl EtcdCluster {
    /// Starts `size` members (at least one) with their data under `dir`. They elect their leader
    /// in the background: a controller waits for them ([`crate::controller::Leadership`]).
    pub fn start(dir: &Path, size: usize) -> std::io::Result<Self> {
        let free = || -> std::io::Result<String> {
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            Ok(format!("http://127.0.0.1:{port}"))
        };
        let size = size.max(1);
        let names: Vec<String> = (0..size).map(|i| format!("e{i}")).collect();
        let peers = names.iter().map(|_| free()).collect::<std::io::Result<Vec<_>>>()?;
        let clients = names.iter().map(|_| free()).collect::<std::io::Result<Vec<_>>>()?;
        let initial: Vec<String> = names.iter().zip(&peers).map(|(n, p)| format!("{n}={p}")).collect();
        let mut cluster = Self { members: Vec::new(), endpoints: clients.join(",") };
        for (i, name) in names.iter().enumerate() {
            let child = Command::new("etcd")
                .args(["--name", name, "--data-dir"])
                .arg(dir.join(name))
                .args(["--listen-peer-urls", &peers[i], "--initial-advertise-peer-urls", &peers[i]])
                .args(["--listen-client-urls", &clients[i], "--advertise-client-urls", &clients[i]])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "dejavu-local"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| std::io::Error::new(e.kind(), format!("etcd (Debian's etcd-server): {e}")))?;
            cluster.members.push(child);
        }
        Ok(cluster)
    }

    /// Its client URLs, comma-separated (as `controller --etcd` takes them).
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            let _ = member.kill();
            let _ = member.wait();
        }
    }
}
