//! The replication wire client: a `replication=database` connection spoken with `postgres-protocol`
//! (`connection`), its authentication exchange as a pure state machine (`auth`), and the pure codec for the
//! messages inside its CopyBoth stream (`protocol`).

pub mod auth;
pub mod connection;
pub mod protocol;

pub use connection::{
    CreatedSlot, ReplicationConnection, ReplicationError, ReplicationStream, SystemIdentity,
};
pub use protocol::ServerMessage;
