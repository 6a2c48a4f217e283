//! High availability on etcd: several controllers of one cluster, one leader, the control state
//! in etcd.
//!
//! - **Election.** Each controller holds an etcd lease, kept alive a few times per TTL, and
//!   campaigns on the cluster's election (`/dejavu/<cluster>/leader`) with its address as the
//!   value. Whoever etcd makes leader serves; the others wait in the campaign. A leader whose
//!   process dies, is paused or is cut off from etcd stops keeping its lease alive: etcd expires
//!   it within its TTL, which deletes its leadership key and elects the next.
//! - **The record in etcd.** The leader keeps its machine's [`Record`] (epochs, members, fences)
//!   at `/dejavu/<cluster>/record`, in the state file's text, and a new leader starts from it.
//! - **Fencing of an old leader.** Every write is a transaction that succeeds only while the
//!   writer's leadership key still exists with the revision it was created at. A leader that was
//!   paused or cut off past its lease therefore cannot write a fence, so it can never issue an
//!   epoch after its successor has: its write fails, it learns it lost the leadership, and it
//!   exits (a supervisor starts it again, and it campaigns anew).
//! - **A leader that cannot renew.** A renewal stream that breaks (the etcd member it went to
//!   died) is opened again through the other endpoints. A renewal that etcd does not answer
//!   before the lease may have expired (etcd down, or this controller cut off from it) ends the
//!   leadership as a refused one does: the controller stops, and a supervisor starts it again
//!   to stand by.
//! - **Stopping.** A leader stopped by SIGTERM or SIGINT revokes its lease before it exits
//!   ([`Leadership::resignation`]): a controller standing by takes over at once.
//! - **A leader that died.** A controller standing by connects to the leader's address (the
//!   election's value) every [`PROBE_EVERY`]. A refused connection means no process listens
//!   there: the leader's process is gone, though its lease lives on until its TTL. The controller
//!   standing by then revokes that lease, and the next leader takes over within a probe rather
//!   than a TTL. A leader that is paused or cut off does not refuse (its port is bound, or its
//!   host does not answer): its lease lapses with its TTL, as before.
//! - **A secured etcd.** TLS, a client certificate and etcd's user authentication come from
//!   [`EtcdAccess`]. etcd's authentication tokens expire (`--auth-token-ttl`, 5 minutes by
//!   default); a request refused for an expired token gets a new one and is tried once more.
//! - **An etcd member that died.** A request that went to a member that cannot be reached is
//!   asked again, a few times, of the others (every request here is idempotent).
//! - **Standing by.** A controller says it stands by (`waiting`) as soon as etcd names another
//!   leader, or once its campaign has waited `STANDBY_AFTER` (half a second). A campaign that
//!   fails revokes its lease before it tries again, so that its key does not hold the election
//!   for a TTL.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, LeaderKey, LeaseKeepAliveStream, LeaseKeeper, Txn, TxnOp};
use tracing::{error, info};

use super::etcd_access::EtcdAccess;
use super::state::State;
use super::ControllerError;
use dejavu_proto::liveness::Record;

/// Where the controllers of a cluster meet in etcd.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// The etcd cluster's client URLs.
    pub endpoints: Vec<String>,
    /// The DéjàVu cluster's name: its keys are under `/dejavu/<cluster>/`.
    pub cluster: String,
    /// The lease's time to live: how long a leader that stopped renewing it stays leader.
    pub lease_ttl: Duration,
    /// TLS and credentials for a secured etcd (none by default).
    pub access: EtcdAccess,
}

impl EtcdConfig {
    fn election(&self) -> String {
        format!("/dejavu/{}/leader", self.cluster)
    }

    fn record_key(&self) -> String {
        format!("/dejavu/{}/record", self.cluster)
    }
}

/// How long a controller waits for etcd to answer at its start.
const ETCD_PATIENCE: Duration = Duration::from_secs(30);

/// How long a guarded write may take.
const WRITE_DEADLINE: Duration = Duration::from_secs(5);

/// How often a controller standing by checks that the leader's process still listens.
pub const PROBE_EVERY: Duration = Duration::from_millis(100);

/// This controller's leadership of its cluster (see the module's documentation).
pub struct Leadership {
    runtime: tokio::runtime::Runtime,
    client: Client,
    config: EtcdConfig,
    leader: LeaderKey,
    /// Set once the lease could not be renewed or a guarded write failed.
    lost: Arc<AtomicBool>,
}

/// How long a campaign may take before its controller says it stands by.
const STANDBY_AFTER: Duration = Duration::from_millis(500);

fn etcd_error(e: impl std::fmt::Display) -> ControllerError {
    ControllerError::Etcd(e.to_string())
}

impl Leadership {
    /// Campaigns, announcing `addr`, until this controller leads the cluster (`waiting` is called
    /// once if another leads meanwhile).
    pub fn campaign(
        config: EtcdConfig,
        addr: SocketAddr,
        waiting: impl FnOnce(Option<String>),
    ) -> Result<Self, ControllerError> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let mut waiting = Some(waiting);
        // etcd may be starting too, or electing its own leader: a start that cannot reach it is
        // tried again for a while; once it could, a campaign that fails is tried again for good
        // (a controller standing by waits as long as it must).
        let started = std::time::Instant::now();
        let mut reached = false;
        loop {
            let lost = Arc::new(AtomicBool::new(false));
            let attempt =
                runtime.block_on(Self::try_campaign(&config, addr, &lost, &mut waiting, &mut reached));
            match attempt {
                Ok((mut client, leader, keeping)) => {
                    if lost.load(Ordering::SeqCst) {
                        keeping.abort();
                        // Its key would hold the election for a TTL, this controller waiting
                        // behind its own former self.
                        runtime.block_on(give_up(&mut client, leader.lease()));
                        continue;
                    }
                    info!(cluster = %config.cluster, %addr, "leading the cluster");
                    return Ok(Self { runtime, client, config, leader, lost });
                }
                Err(e) if credentials_refused(&e) => {
                    return Err(etcd_error(format!(
                        "etcd refused this controller's credentials (--etcd-user, --etcd-password-file): {e}"
                    )))
                }
                Err(e) if reached || started.elapsed() < ETCD_PATIENCE => {
                    tracing::warn!(error = %e, "campaigning through etcd: trying again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(etcd_error(e)),
            }
        }
    }

    /// One campaign: a lease, kept alive (its end sets `lost`), then the election, announcing
    /// `addr`; `waiting` is told once if another leads. Returns the client, the leadership key and
    /// the task keeping the lease alive.
    async fn try_campaign(
        config: &EtcdConfig,
        addr: SocketAddr,
        lost: &Arc<AtomicBool>,
        waiting: &mut Option<impl FnOnce(Option<String>)>,
        reached: &mut bool,
    ) -> Result<(Client, LeaderKey, tokio::task::JoinHandle<()>), etcd_client::Error> {
        let ttl = config.lease_ttl.as_secs().max(1) as i64;
        // No timeout per request: a campaign waits as long as another leads.
        let options = config.access.options(Duration::from_secs(5));
        let mut client = Client::connect(&config.endpoints, Some(options)).await?;
        let asked = tokio::time::Instant::now();
        let lease = client.lease_grant(ttl, None).await?.id();
        *reached = true;
        match Self::campaign_on(config, addr, lost, waiting, client.clone(), lease, asked).await {
            Ok(won) => Ok(won),
            Err(e) => {
                // A key of this attempt's would hold the election until its lease lapsed.
                give_up(&mut client, lease).await;
                Err(e)
            }
        }
    }

    /// The rest of [`Leadership::try_campaign`], on the lease `lease` asked for at `asked`.
    async fn campaign_on(
        config: &EtcdConfig,
        addr: SocketAddr,
        lost: &Arc<AtomicBool>,
        waiting: &mut Option<impl FnOnce(Option<String>)>,
        mut client: Client,
        lease: i64,
        asked: tokio::time::Instant,
    ) -> Result<(Client, LeaderKey, tokio::task::JoinHandle<()>), etcd_client::Error> {
        let ttl = config.lease_ttl.as_secs().max(1) as i64;
        let renewals = client.lease_keep_alive(lease).await?;
        let keeping =
            tokio::spawn(keep_alive(client.clone(), lease, renewals, asked, ttl as u64, lost.clone()));
        let election = config.election();
        let holder = client.leader(election.clone()).await.ok();
        let holder = holder.and_then(|r| r.kv().and_then(|kv| kv.value_str().ok().map(str::to_owned)));
        if let Some(holder) = holder {
            if let Some(tell) = waiting.take() {
                tell(Some(holder));
            }
        }
        let watching = tokio::spawn(depose_the_dead(client.clone(), election.clone(), addr));
        let mut campaigner = client.clone();
        let campaign = campaigner.campaign(election, addr.to_string(), lease);
        tokio::pin!(campaign);
        // A campaign that does not end at once waits behind a leader, even where etcd could not
        // say who leads (a request that went to an etcd member that died, say).
        let campaign = tokio::select! {
            won = &mut campaign => won,
            () = tokio::time::sleep(STANDBY_AFTER) => {
                if let Some(tell) = waiting.take() {
                    tell(None);
                }
                campaign.await
            }
        };
        watching.abort();
        let won = match campaign {
            Ok(won) => won,
            Err(e) => {
                keeping.abort();
                return Err(e);
            }
        };
        match won.leader().cloned() {
            Some(leader) => Ok((client, leader, keeping)),
            None => {
                keeping.abort();
                Err(etcd_client::Error::InvalidArgs("a campaign won without a key".into()))
            }
        }
    }

    /// The record the cluster's last leader kept (a fresh cluster's if none).
    pub fn load(&mut self) -> Result<Record, ControllerError> {
        let key = self.config.record_key();
        let client = &self.client;
        let found = self
            .runtime
            .block_on(ask_etcd(client, || {
                let mut client = client.clone();
                let key = key.clone();
                async move { client.get(key, None).await }
            }))
            .map_err(etcd_error)?;
        match found.kvs().first() {
            None => Ok(Record::default()),
            Some(kv) => {
                let text = kv.value_str().map_err(etcd_error)?;
                State::parse(text).map_err(|why| ControllerError::Etcd(format!("{key}: {why}")))
            }
        }
    }

    /// Writes `record`, only while this controller still leads; otherwise the leadership is lost
    /// ([`ControllerError::NotLeader`]) and nothing was written.
    pub fn save(&mut self, record: &Record) -> Result<(), ControllerError> {
        let write = TxnOp::put(self.config.record_key(), State::encode(record), None);
        self.guarded(&[write])
    }

    /// Checks with etcd that this controller still leads, writing nothing: what a leader does
    /// before it acts on a member (hands a spare a stage's place), so that one paused past its
    /// lease learns it was deposed before it acts, not after.
    pub fn confirm(&mut self) -> Result<(), ControllerError> {
        self.guarded(&[])
    }

    /// Carries `writes` out in one transaction, only while this controller still leads.
    fn guarded(&mut self, writes: &[TxnOp]) -> Result<(), ControllerError> {
        if self.lost() {
            return Err(ControllerError::NotLeader);
        }
        let still_leading =
            Compare::create_revision(self.leader.key().to_vec(), CompareOp::Equal, self.leader.rev());
        let txn = Txn::new().when([still_leading]).and_then(writes.to_vec());
        let client = &self.client;
        let done = self
            .runtime
            .block_on(async {
                let write = ask_etcd(client, || {
                    let mut client = client.clone();
                    let txn = txn.clone();
                    async move { client.txn(txn).await }
                });
                tokio::time::timeout(WRITE_DEADLINE, write).await
            })
            .map_err(|_| etcd_error("a write took too long"))?
            .map_err(etcd_error)?;
        if !done.succeeded() {
            self.lost.store(true, Ordering::SeqCst);
            error!(cluster = %self.config.cluster, "lost the leadership: a newer leader holds the cluster");
            return Err(ControllerError::NotLeader);
        }
        Ok(())
    }

    /// What gives the leadership up at once, for a controller that stops: its lease is revoked,
    /// which deletes its leadership key, so that a controller standing by takes over without
    /// waiting for the lease to expire.
    pub fn resignation(&self) -> impl FnOnce() + Send + 'static {
        let (handle, client, lease) =
            (self.runtime.handle().clone(), self.client.clone(), self.leader.lease());
        let cluster = self.config.cluster.clone();
        move || match handle.block_on(async {
            let revoke = ask_etcd(&client, || {
                let mut client = client.clone();
                async move { client.lease_revoke(lease).await }
            });
            tokio::time::timeout(WRITE_DEADLINE, revoke).await
        }) {
            Ok(Ok(_)) => info!(%cluster, "gave the leadership up"),
            Ok(Err(e)) => {
                error!(%cluster, error = %e, "could not give the leadership up: it lapses with the lease")
            }
            Err(_) => error!(%cluster, "giving the leadership up took too long: it lapses with the lease"),
        }
    }

    /// Whether the leadership was lost (the lease expired, or a guarded write failed).
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// Renews `lease` (granted for `ttl` seconds, asked for at `asked`) three times a TTL over
/// `renewals`, until a renewal fails for good; then sets `lost`.
///
/// A renewal stream that breaks (the etcd member it went to died) is opened again, through the
/// client's other endpoints. A renewal that etcd answers with the lease gone, or that is not
/// answered before the lease may have expired (etcd down, or this controller cut off from it),
/// ends the leadership: counted from before the last renewal that succeeded was sent, so never
/// later than etcd counts it.
async fn keep_alive(
    mut client: Client,
    lease: i64,
    renewals: (LeaseKeeper, LeaseKeepAliveStream),
    asked: tokio::time::Instant,
    ttl: u64,
    lost: Arc<AtomicBool>,
) {
    let lease_ttl = Duration::from_secs(ttl);
    let every = (lease_ttl / 3).max(Duration::from_millis(100));
    let mut renewed_from = asked;
    let mut renewals = Some(renewals);
    loop {
        let sent = tokio::time::Instant::now();
        let renewal = async {
            loop {
                let (keeper, answers) = match renewals.as_mut() {
                    Some(stream) => stream,
                    None => match client.lease_keep_alive(lease).await {
                        Ok(stream) => renewals.insert(stream),
                        Err(_) => {
                            tokio::time::sleep(REOPEN_PAUSE).await;
                            continue;
                        }
                    },
                };
                let answer = match keeper.keep_alive().await {
                    Ok(()) => answers.message().await,
                    Err(e) => Err(e),
                };
                match answer {
                    // A TTL of 0: etcd no longer holds the lease.
                    Ok(Some(answer)) => return answer.ttl() > 0,
                    // The stream broke: another is opened.
                    Ok(None) | Err(_) => {
                        renewals = None;
                        tokio::time::sleep(REOPEN_PAUSE).await;
                    }
                }
            }
        };
        let left = lease_ttl.saturating_sub(renewed_from.elapsed());
        let renewed = tokio::time::timeout(left, renewal).await.unwrap_or(false);
        if !renewed {
            lost.store(true, Ordering::SeqCst);
            return;
        }
        renewed_from = sent;
        tokio::time::sleep(every).await;
    }
}

/// How long a broken renewal stream waits before it is opened again.
const REOPEN_PAUSE: Duration = Duration::from_millis(50);

/// While this controller (at `addr`) campaigns: revokes the lease of a leader whose address
/// refuses connections, its process gone (see the module's documentation). A leader that
/// announced an address of any interface (`0.0.0.0`) cannot be probed from elsewhere: it is left
/// to its TTL.
async fn depose_the_dead(mut client: Client, election: String, addr: SocketAddr) {
    loop {
        tokio::time::sleep(PROBE_EVERY).await;
        let Ok(answer) = client.leader(election.clone()).await else { continue };
        let Some(kv) = answer.kv() else { continue };
        let Some(leader) = kv.value_str().ok().and_then(|v| v.parse::<SocketAddr>().ok()) else { continue };
        if leader == addr || leader.ip().is_unspecified() {
            continue;
        }
        let probe = tokio::time::timeout(PROBE_EVERY, tokio::net::TcpStream::connect(leader)).await;
        if let Ok(Err(e)) = probe {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                info!(%leader, "the leader's address refuses connections, its process gone: revoking its lease");
                if let Err(e) = client.lease_revoke(kv.lease()).await {
                    tracing::warn!(%leader, error = %e, "could not revoke the dead leader's lease: it lapses with its TTL");
                }
            }
        }
    }
}

/// Revokes `lease`, given up by a campaign that failed, if etcd answers within a moment: its key,
/// if it has one, then leaves the election at once rather than after its TTL. A lease etcd does
/// not revoke lapses by itself.
async fn give_up(client: &mut Client, lease: i64) {
    let revoke = client.lease_revoke(lease);
    if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(1), revoke).await {
        tracing::debug!(error = %e, "could not revoke a campaign's lease");
    }
}

/// Whether etcd refused a request for its authentication token (expired, or revoked when etcd
/// restarted), rather than for what it asked.
fn token_refused(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(status)
        if status.code() == tonic::Code::Unauthenticated || status.message().contains("invalid auth token"))
}

/// Whether etcd refused this controller's credentials: a wrong user or password, or a user not
/// allowed the cluster's keys. Trying again cannot help.
fn credentials_refused(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(status)
        if status.code() == tonic::Code::PermissionDenied || status.message().contains("authentication failed"))
}

/// Whether a request failed only because the etcd member it went to could not be reached (it
/// died, say): another member may answer the same request.
fn member_unreachable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(status) => status.code() == tonic::Code::Unavailable,
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Tries at most for a request that went to an etcd member that could not be reached.
const UNREACHABLE_TRIES: u32 = 10;

/// Runs `request`; if etcd refused its token, gets a new one and runs it once more; if the
/// member it went to could not be reached, runs it again a few times (the client's balancer
/// sends it to another member once it has found that one down). Every request here is
/// idempotent: a guarded write of the same record, or a read.
async fn ask_etcd<T, F, R>(client: &Client, request: R) -> Result<T, etcd_client::Error>
where
    R: Fn() -> F,
    F: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let mut tries = 1;
    loop {
        match request().await {
            Err(e) if token_refused(&e) => {
                tracing::debug!(error = %e, "etcd refused the authentication token: getting a new one");
                client.refresh_token().await?;
                return request().await;
            }
            Err(e) if member_unreachable(&e) && tries < UNREACHABLE_TRIES => {
                tracing::debug!(error = %e, "an etcd member could not be reached: asking again");
                tries += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            answered => return answered,
        }
    }
}
