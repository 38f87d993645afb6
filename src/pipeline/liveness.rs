//! The connections that hold advisory locks (the leadership lock, the fleet's table markers) and the
//! replication stream must notice a peer gone silent (a node lost, a network partition) within seconds, not
//! the operating system's two hours: dead-peer detection on both ends of the socket, how often a lock
//! session proves it is alive, and how to find a lock in `pg_locks`. Used by `leader` and `fleet`; owns no
//! connection.

use std::time::Duration;

/// How often the leader proves that its lock session is alive (and keeps it from looking idle).
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
/// How long any statement on the lock connection may take before the connection counts as dead.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
/// A leader whose lock session ran no statement for this long is gone: a standby ends its session.
/// Far above [`HEALTH_INTERVAL`], so a live leader is never taken for a dead one.
pub const SILENT_LEADER: Duration = Duration::from_secs(15);
/// TCP keepalives on the lock connection, client and server side: first probe after this much silence...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// ...then one probe every...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// ...and the connection is dropped after this many unanswered probes.
const KEEPALIVE_COUNT: u32 = 3;
/// Data unacknowledged this long drops the connection (`tcp_user_timeout`, both sides; also the connect
/// timeout of the lock connection when the URL sets none).
const USER_TIMEOUT: Duration = Duration::from_secs(15);

/// The session settings of the lock connection: the server's side of dead-peer detection (PostgreSQL
/// applies these to its socket for this session), and no idle-session kill of a connection that idles
/// between health queries by design.
pub fn session_settings() -> String {
    format!(
        "SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; SET tcp_keepalives_count = {}; \
         SET tcp_user_timeout = {}; SET idle_session_timeout = 0; SET idle_in_transaction_session_timeout = 0",
        KEEPALIVE_IDLE.as_secs(),
        KEEPALIVE_INTERVAL.as_secs(),
        KEEPALIVE_COUNT,
        USER_TIMEOUT.as_millis()
    )
}

/// The rows of `pg_locks` that are the leadership lock for `$1` (the key text) in this database.
pub const LOCK_ROWS: &str =
    "pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    AND ((l.classid::int8 << 32) | l.objid::int8) = hashtext($1)::int8";

/// The URL with dead-peer detection on the client's socket, for the connections a silent server must end:
/// the leadership lock, the fleet announcements and the replication stream.
pub fn with_dead_peer_detection(url: &crate::pg::PgUrl) -> crate::pg::PgUrl {
    url.with_dead_peer_detection(
        KEEPALIVE_IDLE,
        KEEPALIVE_INTERVAL,
        KEEPALIVE_COUNT,
        USER_TIMEOUT,
    )
}
