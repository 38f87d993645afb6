//! The replication wire client: a `replication=database` connection spoken with `postgres-protocol`
//! (`connection`) and the pure codec for the messages inside its CopyBoth stream (`protocol`).

pub mod connection;
pub mod protocol;

pub use connection::{
    CreatedSlot, ReplicationConnection, ReplicationError, ReplicationStream, SystemIdentity,
};
pub use protocol::ServerMessage;
