//! A local etcd cluster on loopback, in a directory of its own: for the tests and benchmarks of
//! the controllers' high availability (`dejavud controller --etcd`), and for trying it out. Needs
//! `etcd` on the PATH (Debian's `etcd-server`). Its members are killed when it is dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// TLS on an etcd cluster's client URLs, which then are `https://localhost:PORT`.
#[derive(Clone, Debug)]
pub struct ClientTls {
    /// The members' certificate (PEM), valid for the name `localhost`.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The authority whose certificates clients must present (etcd's `--client-cert-auth`).
    pub ca: PathBuf,
}

/// How a local etcd cluster is started beyond the defaults.
#[derive(Clone, Debug, Default)]
pub struct EtcdOptions {
    /// TLS on its client URLs, clients' certificates required.
    pub tls: Option<ClientTls>,
    /// Seconds its authentication tokens live (etcd's `--auth-token-ttl`; 300 by default).
    pub auth_token_ttl: Option<u64>,
}

/// The members of a local etcd cluster.
pub struct EtcdCluster {
    /// Each member's process; `None` once killed.
    members: Vec<Option<Child>>,
    endpoints: String,
    /// Each member's client port on loopback.
    ports: Vec<u16>,
}

impl EtcdCluster {
    /// Starts `size` members (at least one) with their data under `dir`. They elect their leader
    /// in the background: a controller waits for them ([`crate::controller::Leadership`]).
    pub fn start(dir: &Path, size: usize) -> std::io::Result<Self> {
        Self::start_with(dir, size, &EtcdOptions::default())
    }

    /// As [`EtcdCluster::start`], with `options`.
    pub fn start_with(dir: &Path, size: usize, options: &EtcdOptions) -> std::io::Result<Self> {
        let free = || -> std::io::Result<u16> {
            Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
        };
        let size = size.max(1);
        let names: Vec<String> = (0..size).map(|i| format!("e{i}")).collect();
        let peers = names
            .iter()
            .map(|_| Ok(format!("http://127.0.0.1:{}", free()?)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let ports = names.iter().map(|_| free()).collect::<std::io::Result<Vec<_>>>()?;
        // With TLS, clients reach the members by the name their certificate holds.
        let (scheme, host) =
            if options.tls.is_some() { ("https", "localhost") } else { ("http", "127.0.0.1") };
        let listen: Vec<String> = ports.iter().map(|port| format!("{scheme}://127.0.0.1:{port}")).collect();
        let clients: Vec<String> = ports.iter().map(|port| format!("{scheme}://{host}:{port}")).collect();
        let initial: Vec<String> = names.iter().zip(&peers).map(|(n, p)| format!("{n}={p}")).collect();
        let mut cluster = Self { members: Vec::new(), endpoints: clients.join(","), ports: ports.clone() };
        for (i, name) in names.iter().enumerate() {
            let mut command = Command::new("etcd");
            command
                .args(["--name", name, "--data-dir"])
                .arg(dir.join(name))
                .args(["--listen-peer-urls", &peers[i], "--initial-advertise-peer-urls", &peers[i]])
                .args(["--listen-client-urls", &listen[i], "--advertise-client-urls", &clients[i]])
                .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "dejavu-local"]);
            if let Some(tls) = &options.tls {
                command.arg("--cert-file").arg(&tls.cert).arg("--key-file").arg(&tls.key);
                command.arg("--trusted-ca-file").arg(&tls.ca).arg("--client-cert-auth");
            }
            if let Some(ttl) = options.auth_token_ttl {
                command.args(["--auth-token-ttl", &ttl.to_string()]);
            }
            let child =
                command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| {
                    std::io::Error::new(e.kind(), format!("etcd (Debian's etcd-server): {e}"))
                })?;
            cluster.members.push(Some(child));
        }
        Ok(cluster)
    }

    /// Kills member `index` (a machine of the etcd cluster lost); the others keep a quorum while
    /// more than half of them live.
    pub fn kill_member(&mut self, index: usize) {
        if let Some(mut member) = self.members.get_mut(index).and_then(Option::take) {
            let _ = member.kill();
            let _ = member.wait();
        }
    }

    /// Sends `signal` to every member (SIGSTOP: etcd stops answering, as when it is down or cut
    /// off; SIGCONT: it answers again).
    pub fn signal_all(&self, signal: i32) {
        for member in self.members.iter().flatten() {
            // SAFETY: kill(2) on the pid of a child this cluster started and has not reaped.
            unsafe { libc::kill(member.id() as i32, signal) };
        }
    }

    /// Its members' client addresses on loopback, in order.
    pub fn client_addrs(&self) -> Vec<std::net::SocketAddr> {
        self.ports.iter().map(|&port| std::net::SocketAddr::from(([127, 0, 0, 1], port))).collect()
    }

    /// The client addresses of its members still alive.
    pub fn live_client_addrs(&self) -> Vec<std::net::SocketAddr> {
        let alive = self.members.iter().map(Option::is_some);
        self.client_addrs().into_iter().zip(alive).filter_map(|(addr, alive)| alive.then_some(addr)).collect()
    }

    /// Its client URLs, comma-separated (as `controller --etcd` takes them).
    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }
}

impl EtcdCluster {
    /// Kills every member (as dropping it does).
    pub fn kill_all(&mut self) {
        for index in 0..self.members.len() {
            self.kill_member(index);
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}
