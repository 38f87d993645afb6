//! Which PostgreSQL majors outboxd supports, and what each one changes in how outboxd talks to it: the
//! replication commands' syntax and the features a major adds (failover slots in 17). Pure: the version is
//! read by the caller (`server_version`), nothing here does I/O.

use crate::error::{Error, Result};

/// The oldest major outboxd supports: pgoutput's logical decoding messages and the streaming options it
/// uses arrived in 14.
pub const OLDEST_SUPPORTED: i32 = 14;
/// The newest major outboxd is tested on; a newer one is run, with a warning.
pub const NEWEST_TESTED: i32 = 18;

/// A server's version as `server_version_num` gives it (170011 for 17.11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion(pub i32);

impl ServerVersion {
    /// The major release (17 for 170011).
    pub fn major(self) -> i32 {
        self.0 / 10_000
    }

    /// Refuses a major older than [`OLDEST_SUPPORTED`], naming it and the fix; `Ok(false)` when the major is
    /// newer than any outboxd is tested on (it runs; the caller warns), `Ok(true)` otherwise.
    pub fn check_supported(self) -> Result<bool> {
        let major = self.major();
        if major < OLDEST_SUPPORTED {
            return Err(Error::setup(
                format!(
                    "PostgreSQL {major} is not supported: outboxd needs PostgreSQL {OLDEST_SUPPORTED} or newer (it is tested on {OLDEST_SUPPORTED} to {NEWEST_TESTED})"
                ),
                format!("upgrade the server to PostgreSQL {OLDEST_SUPPORTED} or newer (pg_upgrade, or your service's major version upgrade)"),
            ));
        }
        Ok(major <= NEWEST_TESTED)
    }

    /// PostgreSQL 17 added failover slots (`failover`, `sync_replication_slots`).
    pub fn has_failover_slots(self) -> bool {
        self.major() >= 17
    }

    /// The `CREATE_REPLICATION_SLOT` command for a pgoutput slot named `slot` (a validated name) that
    /// exports its snapshot; `failover` asks for a failover slot where the server has them. 14 knows only
    /// the legacy syntax (`EXPORT_SNAPSHOT`); options in parentheses came in 15.
    pub fn create_slot_command(self, slot: &str, failover: bool) -> String {
        if self.major() < 15 {
            format!("CREATE_REPLICATION_SLOT \"{slot}\" LOGICAL pgoutput EXPORT_SNAPSHOT")
        } else if failover && self.has_failover_slots() {
            format!(
                "CREATE_REPLICATION_SLOT \"{slot}\" LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
            )
        } else {
            format!("CREATE_REPLICATION_SLOT \"{slot}\" LOGICAL pgoutput (SNAPSHOT 'export')")
        }
    }

    /// The `ALTER_REPLICATION_SLOT` command that makes `slot` a failover slot or not (17+).
    pub fn alter_failover_command(slot: &str, failover: bool) -> String {
        format!("ALTER_REPLICATION_SLOT \"{slot}\" (FAILOVER {failover})")
    }
}

impl std::fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major(), self.0 % 10_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn majors_older_than_14_are_refused_with_the_fix_and_newer_than_18_only_flagged() {
        let error = ServerVersion(130_016).check_supported().unwrap_err();
        let text = error.to_string();
        assert!(text.contains("PostgreSQL 13 is not supported"), "{text}");
        assert!(text.contains("upgrade"), "{text}");
        assert!(ServerVersion(140_018).check_supported().unwrap());
        assert!(ServerVersion(180_006).check_supported().unwrap());
        assert!(!ServerVersion(190_000).check_supported().unwrap());
    }

    #[test]
    fn slot_creation_uses_the_syntax_each_major_knows() {
        assert_eq!(
            ServerVersion(140_018).create_slot_command("s", true),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput EXPORT_SNAPSHOT"
        );
        assert_eq!(
            ServerVersion(160_004).create_slot_command("s", true),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
        );
        assert_eq!(
            ServerVersion(170_011).create_slot_command("s", true),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
        );
        assert_eq!(
            ServerVersion(180_006).create_slot_command("s", false),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
        );
        assert_eq!(
            ServerVersion::alter_failover_command("s", true),
            "ALTER_REPLICATION_SLOT \"s\" (FAILOVER true)"
        );
    }

    #[test]
    fn shows_major_and_minor() {
        assert_eq!(ServerVersion(170_011).to_string(), "17.11");
        assert_eq!(ServerVersion(140_024).major(), 14);
    }
}
