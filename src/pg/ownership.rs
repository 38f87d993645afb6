//! Whom outboxd trusts to own an object it uses with its rights (a table it writes to or adopts, a schema it
//! creates in, the publication it streams through): SQL fragments shared by migrate, the start-up checks and
//! retention. What each caller does with an untrusted owner (refuse, and the fix it names) is the caller's.

/// SQL: whether the role with oid `owner` (an expression) holds the rights of the current role already, so
/// that code of theirs running with them gains nothing: this role; a superuser; a role that is a member of
/// this one, unless this one is a superuser (membership in a superuser role does not make a superuser). A
/// role this one is a member of is not trusted: its code would run with rights it does not have.
pub(crate) fn trusted_owner(owner: &str) -> String {
    format!(
        "(SELECT {owner} = me.oid OR coalesce((SELECT rolsuper FROM pg_roles WHERE oid = {owner}), false)
                OR (NOT me.rolsuper AND pg_has_role({owner}, me.oid, 'MEMBER'))
          FROM pg_roles me WHERE me.rolname = current_user)"
    )
}

/// SQL: the owner of schema `$1`, `pg_database_owner` (PostgreSQL 15+) read as the database's owner.
pub(crate) const SCHEMA_OWNER: &str = "SELECT CASE WHEN n.nspowner = (SELECT oid FROM pg_roles WHERE rolname = 'pg_database_owner')
                 THEN (SELECT datdba FROM pg_database WHERE datname = current_database()) ELSE n.nspowner END
             FROM pg_namespace n WHERE n.nspname = $1";
