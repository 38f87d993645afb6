//! Pure codec for the streaming-replication sub-protocol carried in CopyData: XLogData ('w') and primary
//! keepalive ('k') from the server, standby status update ('r') to it. No I/O.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::lsn::Lsn;

/// Seconds between the Unix epoch and PostgreSQL's epoch (2000-01-01 00:00:00 UTC).
const PG_EPOCH_OFFSET_SECS: u64 = 946_684_800;

/// A message from the server inside the CopyBoth stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerMessage {
    /// WAL data: for logical replication, one pgoutput message. Header positions are not ack positions.
    XLogData {
        /// Start of the WAL data in this message.
        wal_start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        /// The payload: one pgoutput message.
        data: Bytes,
    },
    /// The server's current WAL end, and whether it wants a status update now.
    Keepalive {
        /// The server's current end of WAL.
        wal_end: Lsn,
        /// The server asks for a status update right away.
        reply_requested: bool,
    },
}

/// A replication CopyData message that cannot be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// Shorter than its type's fixed header; holds its length in bytes.
    #[error("replication CopyData message is truncated ({0} bytes)")]
    Truncated(usize),
    /// A message type other than 'w' (XLogData) and 'k' (keepalive).
    #[error("unknown replication CopyData message type {0:?}")]
    UnknownType(char),
}

/// Decodes one CopyData payload sent by a walsender.
pub fn decode_server_message(mut data: Bytes) -> Result<ServerMessage, ProtocolError> {
    let len = data.len();
    let Some(&tag) = data.first() else {
        return Err(ProtocolError::Truncated(0));
    };
    match tag {
        b'w' if len >= 25 => {
            data.advance(1);
            let wal_start = Lsn(data.get_u64());
            let wal_end = Lsn(data.get_u64());
            let _send_time = data.get_i64();
            Ok(ServerMessage::XLogData {
                wal_start,
                wal_end,
                data,
            })
        }
        b'k' if len >= 18 => {
            data.advance(1);
            let wal_end = Lsn(data.get_u64());
            let _send_time = data.get_i64();
            Ok(ServerMessage::Keepalive {
                wal_end,
                reply_requested: data.get_u8() != 0,
            })
        }
        b'w' | b'k' => Err(ProtocolError::Truncated(len)),
        other => Err(ProtocolError::UnknownType(other as char)),
    }
}

/// Encodes a standby status update. write = flush = apply = `confirmed`: only flush moves a slot, and
/// reporting a received position instead would stop PG 15's idle keepalives.
pub fn encode_status_update(confirmed: Lsn, now: SystemTime, reply_requested: bool) -> Bytes {
    let mut buf = BytesMut::with_capacity(34);
    buf.put_u8(b'r');
    buf.put_u64(confirmed.0);
    buf.put_u64(confirmed.0);
    buf.put_u64(confirmed.0);
    buf.put_i64(pg_timestamp_micros(now));
    buf.put_u8(u8::from(reply_requested));
    buf.freeze()
}

/// Microseconds since PostgreSQL's epoch.
pub fn pg_timestamp_micros(time: SystemTime) -> i64 {
    let since_unix = time.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let micros = since_unix.as_micros() as i64;
    micros - (PG_EPOCH_OFFSET_SECS as i64) * 1_000_000
}

/// The wall-clock time of a PostgreSQL timestamp (microseconds since 2000-01-01).
pub fn system_time_from_pg_micros(micros: i64) -> SystemTime {
    let unix_micros = micros + (PG_EPOCH_OFFSET_SECS as i64) * 1_000_000;
    if unix_micros >= 0 {
        UNIX_EPOCH + Duration::from_micros(unix_micros as u64)
    } else {
        UNIX_EPOCH
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_xlogdata() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&1u64.to_be_bytes());
        raw.extend_from_slice(&2u64.to_be_bytes());
        raw.extend_from_slice(&3i64.to_be_bytes());
        raw.extend_from_slice(b"Bpayload");
        assert_eq!(
            decode_server_message(Bytes::from(raw)).unwrap(),
            ServerMessage::XLogData {
                wal_start: Lsn(1),
                wal_end: Lsn(2),
                data: Bytes::from_static(b"Bpayload")
            }
        );
    }

    #[test]
    fn decodes_keepalive() {
        let mut raw = vec![b'k'];
        raw.extend_from_slice(&0x1_0000_0010u64.to_be_bytes());
        raw.extend_from_slice(&0i64.to_be_bytes());
        raw.push(1);
        assert_eq!(
            decode_server_message(Bytes::from(raw)).unwrap(),
            ServerMessage::Keepalive {
                wal_end: Lsn(0x1_0000_0010),
                reply_requested: true
            }
        );
    }

    #[test]
    fn rejects_short_and_unknown_messages() {
        assert_eq!(
            decode_server_message(Bytes::from_static(b"k123")),
            Err(ProtocolError::Truncated(4))
        );
        assert_eq!(
            decode_server_message(Bytes::new()),
            Err(ProtocolError::Truncated(0))
        );
        assert_eq!(
            decode_server_message(Bytes::from_static(b"z")),
            Err(ProtocolError::UnknownType('z'))
        );
    }

    #[test]
    fn status_update_reports_confirmed_position_three_times() {
        let msg = encode_status_update(
            Lsn(0xABCD),
            UNIX_EPOCH + Duration::from_secs(PG_EPOCH_OFFSET_SECS + 1),
            true,
        );
        assert_eq!(msg.len(), 34);
        assert_eq!(msg[0], b'r');
        for field in 0..3 {
            let start = 1 + field * 8;
            assert_eq!(
                u64::from_be_bytes(msg[start..start + 8].try_into().unwrap()),
                0xABCD
            );
        }
        assert_eq!(
            i64::from_be_bytes(msg[25..33].try_into().unwrap()),
            1_000_000
        );
        assert_eq!(msg[33], 1);
    }

    #[test]
    fn pg_timestamps_round_trip() {
        let t = UNIX_EPOCH + Duration::from_micros(1_800_000_000_123_456);
        assert_eq!(system_time_from_pg_micros(pg_timestamp_micros(t)), t);
    }
}
