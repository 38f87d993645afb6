//! The connections that hold advisory locks (the leadership lock, the fleet's table markers) and the
//! replication stream must notice a peer gone silent (a node lost, a network partition) within seconds, not
//! the operating system's two hours: dead-peer detection on both ends of the socket, how often a lock
//! session proves it is alive, and outboxd's advisory-lock keyspace: how its locks are taken and how to find
//! them in `pg_locks`. Used by `leader`, `fleet`, the claim and `migrate`; owns no connection.

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

/// The first key of every advisory lock outboxd takes: `pg_advisory_lock(OUTBOXD_LOCK_CLASS, hashtext(key))`,
/// shown in `pg_locks` as classid = 1869968482, objid = `hashtext(key)`, objsubid = 2. Applications that lock
/// their own ids with `pg_advisory_lock(bigint)` (objsubid = 1) never meet it. 0x6f757462 is "outb" in ASCII.
/// Earlier versions took `pg_advisory_lock(hashtext(key))`, in the applications' bigint keyspace: see
/// [`LockSpace::Former`].
pub const OUTBOXD_LOCK_CLASS: i32 = 0x6f75_7462;

/// Where an advisory lock of outboxd lives, for finding it in `pg_locks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockSpace {
    /// `(OUTBOXD_LOCK_CLASS, hashtext(key))`: the locks this version takes.
    Outboxd,
    /// `hashtext(key)` as a bigint, the form earlier versions took (and this one also takes, best-effort,
    /// while instances of earlier versions may run beside it). Applications use this keyspace too: a holder
    /// found here is outboxd's only when it says so (its `application_name`, or a shared lock).
    Former,
    /// Either of them.
    Either,
}

impl LockSpace {
    /// Conditions on `pg_locks l` that select the granted advisory lock for key text `key` (a SQL
    /// expression, e.g. `$1`) in this database.
    pub fn lock_filter(self, key: &str) -> String {
        let database =
            "l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";
        let keys = match self {
            LockSpace::Outboxd => outboxd_key(key),
            LockSpace::Former => former_key(key),
            LockSpace::Either => format!("(({}) OR ({}))", outboxd_key(key), former_key(key)),
        };
        format!("l.locktype = 'advisory' AND l.granted AND {database} AND {keys}")
    }
}

fn outboxd_key(key: &str) -> String {
    format!("l.objsubid = 2 AND l.classid = {OUTBOXD_LOCK_CLASS}::oid AND l.objid = hashtext({key})::oid")
}

fn former_key(key: &str) -> String {
    format!("l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = hashtext({key})::int8")
}

/// A condition on the `pg_stat_activity a` row of a lock holder: its role may update every table named in
/// `tables` (a SQL `text[]` expression of quoted names), as every outboxd instance of the fleet must. Any
/// login can take an advisory lock and set its `application_name`; a session counts as an outboxd
/// instance's only with both the name and this privilege (security review M4/L5), and a role that may
/// update the outbox table gains nothing by posing as one.
pub fn may_publish(tables: &str) -> String {
    format!(
        "coalesce((SELECT bool_and(has_table_privilege(a.usesysid, t, 'UPDATE')) FROM unnest({tables}::text[]) t), false)"
    )
}

/// A call of the advisory-lock function `function` for key text `key` (a SQL expression) in outboxd's
/// keyspace: `lock_call("pg_try_advisory_lock", "$1")` is `pg_try_advisory_lock(1869968482, hashtext($1))`.
pub fn lock_call(function: &str, key: &str) -> String {
    format!("{function}({OUTBOXD_LOCK_CLASS}, hashtext({key}))")
}

/// The same lock in the form earlier versions took it (the bigint keyspace): `function(hashtext(key))`.
pub fn former_lock_call(function: &str, key: &str) -> String {
    format!("{function}(hashtext({key}))")
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outboxd_locks_take_their_own_class_and_the_former_form_is_the_bigint_one() {
        assert_eq!(OUTBOXD_LOCK_CLASS.to_be_bytes(), *b"outb");
        assert_eq!(OUTBOXD_LOCK_CLASS, 1_869_968_482);
        assert_eq!(
            lock_call("pg_try_advisory_lock", "$1"),
            "pg_try_advisory_lock(1869968482, hashtext($1))"
        );
        assert_eq!(
            former_lock_call("pg_advisory_xact_lock", "$1"),
            "pg_advisory_xact_lock(hashtext($1))"
        );
        let outboxd = LockSpace::Outboxd.lock_filter("$1");
        assert!(
            outboxd.contains("l.objsubid = 2 AND l.classid = 1869968482::oid"),
            "{outboxd}"
        );
        assert!(LockSpace::Former
            .lock_filter("$1")
            .contains("l.objsubid = 1"));
        let either = LockSpace::Either.lock_filter("$2");
        assert!(
            either.contains("l.objsubid = 2")
                && either.contains("l.objsubid = 1 AND")
                && either.contains("hashtext($2)"),
            "{either}"
        );
    }
}
