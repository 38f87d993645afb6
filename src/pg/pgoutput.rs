//! Pure decoder for the `pgoutput` logical decoding protocol (version 1): bytes of one XLogData payload in,
//! one [`PgOutputMessage`] out. Owns message layout only; it does no I/O and knows nothing about the outbox
//! table (mapping columns to event fields lives in `event`).

use bytes::{Buf, Bytes};

use crate::lsn::Lsn;

/// One decoded pgoutput message. Messages outboxd does not act on are reported as `Skipped` with their tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgOutputMessage {
    /// Start of a transaction ('B').
    Begin(Begin),
    /// End of a transaction ('C').
    Commit(Commit),
    /// A table's description ('R'), sent before the table's first row in a session and again after it changes.
    Relation(Relation),
    /// A new row ('I').
    Insert(Insert),
    /// A logical decoding message ('M', `pg_logical_emit_message`), sent when the stream asks for them.
    Message(Message),
    /// Update, Delete, Truncate, Origin, Type, logical Message, ...: safe to ignore for an insert-only outbox.
    Skipped(u8),
}

/// A Begin message: a transaction starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the commit record (not an ack position).
    pub final_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01 00:00:00 UTC.
    pub commit_time_micros: i64,
    /// Transaction id.
    pub xid: u32,
}

/// A Commit message: every row of the transaction has been sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// LSN of the commit record (the Begin's `final_lsn`; not an ack position).
    pub commit_lsn: Lsn,
    /// End of the commit record: the position to confirm once the transaction is done.
    pub end_lsn: Lsn,
    /// Commit time, microseconds since 2000-01-01 00:00:00 UTC.
    pub commit_time_micros: i64,
}

/// A Relation message: a table's OID, name and columns, which Insert messages refer to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// OID of the table; Insert messages name it as `relation_id`.
    pub id: u32,
    /// Schema of the table.
    pub namespace: String,
    /// Name of the table.
    pub name: String,
    /// The columns, in tuple order.
    pub columns: Vec<RelationColumn>,
}

/// One column of a Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Column name.
    pub name: String,
    /// OID of the column's type (e.g. 17 for bytea).
    pub type_oid: u32,
}

/// A logical decoding message: written by `pg_logical_emit_message(transactional, prefix, content)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Written in its transaction (sent between its Begin and Commit), not on its own.
    pub transactional: bool,
    /// The prefix that says whose message it is.
    pub prefix: String,
    /// The content, as given.
    pub content: Bytes,
}

/// An Insert message: one new row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// OID of the table, as in its Relation message.
    pub relation_id: u32,
    /// The row's values, in the relation's column order.
    pub values: Vec<ColumnValue>,
}

/// A column value of a new tuple, as pgoutput sends it in protocol version 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// SQL NULL.
    Null,
    /// An unchanged TOASTed value (only in updates; listed for completeness).
    UnchangedToast,
    /// The value in the text output format of its type.
    Text(Bytes),
}

impl ColumnValue {
    /// The text-format bytes; `None` for NULL and for an unchanged TOASTed value.
    pub fn as_text(&self) -> Option<&Bytes> {
        match self {
            ColumnValue::Text(bytes) => Some(bytes),
            _ => None,
        }
    }
}

/// A pgoutput message that does not follow the protocol's layout.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// A message of zero bytes.
    #[error("pgoutput message is empty")]
    Empty,
    /// The message ends before a field it must hold.
    #[error(
        "pgoutput message {tag:?} is truncated: needed {needed} more bytes at offset {offset}"
    )]
    Truncated {
        /// Tag of the message (e.g. 'I').
        tag: char,
        /// How many more bytes the field needed.
        needed: usize,
        /// Byte offset of the field in the message.
        offset: usize,
    },
    /// A string without its terminating NUL byte.
    #[error("pgoutput message {tag:?} has a string without its terminating NUL")]
    UnterminatedString {
        /// Tag of the message (e.g. 'R').
        tag: char,
    },
    /// A name (of a schema, table or column) that is not UTF-8.
    #[error("pgoutput message {tag:?} has a string that is not UTF-8")]
    NotUtf8 {
        /// Tag of the message (e.g. 'R').
        tag: char,
    },
    /// A tuple column kind other than NULL ('n'), unchanged TOAST ('u') and text ('t').
    #[error("pgoutput message {tag:?} has unknown tuple column kind {kind:?}")]
    UnknownColumnKind {
        /// Tag of the message (e.g. 'I').
        tag: char,
        /// The column kind byte found (outboxd knows 'n', 'u' and 't').
        kind: char,
    },
    /// A column count or value length below zero.
    #[error("pgoutput message {tag:?} has a negative count or length {value}")]
    NegativeLength {
        /// Tag of the message (e.g. 'I').
        tag: char,
        /// The count or length as read.
        value: i64,
    },
    /// An Insert whose tuple is not marked 'N' (new tuple).
    #[error("pgoutput insert has tuple marker {0:?}, expected 'N'")]
    BadTupleMarker(char),
}

/// Decodes one pgoutput message (the payload of an XLogData message).
pub fn decode(data: Bytes) -> Result<PgOutputMessage, DecodeError> {
    let tag = *data.first().ok_or(DecodeError::Empty)?;
    let mut reader = Reader {
        data,
        offset: 1,
        tag,
    };
    let message = match tag {
        b'B' => PgOutputMessage::Begin(Begin {
            final_lsn: Lsn(reader.u64()?),
            commit_time_micros: reader.i64()?,
            xid: reader.u32()?,
        }),
        b'C' => {
            let _flags = reader.u8()?;
            PgOutputMessage::Commit(Commit {
                commit_lsn: Lsn(reader.u64()?),
                end_lsn: Lsn(reader.u64()?),
                commit_time_micros: reader.i64()?,
            })
        }
        b'R' => {
            let id = reader.u32()?;
            let namespace = reader.string()?;
            let name = reader.string()?;
            let _replica_identity = reader.u8()?;
            let count = reader.count()?;
            let mut columns = Vec::with_capacity(count.min(1600));
            for _ in 0..count {
                let _flags = reader.u8()?;
                let name = reader.string()?;
                let type_oid = reader.u32()?;
                let _type_modifier = reader.u32()?;
                columns.push(RelationColumn { name, type_oid });
            }
            PgOutputMessage::Relation(Relation {
                id,
                namespace,
                name,
                columns,
            })
        }
        b'I' => {
            let relation_id = reader.u32()?;
            let marker = reader.u8()?;
            if marker != b'N' {
                return Err(DecodeError::BadTupleMarker(marker as char));
            }
            let count = reader.count()?;
            let mut values = Vec::with_capacity(count.min(1600));
            for _ in 0..count {
                values.push(reader.column_value()?);
            }
            PgOutputMessage::Insert(Insert {
                relation_id,
                values,
            })
        }
        b'M' => {
            let flags = reader.u8()?;
            let _lsn = reader.u64()?;
            let prefix = reader.string()?;
            let length = reader.take(4)?.get_i32();
            let length = usize::try_from(length).map_err(|_| DecodeError::NegativeLength {
                tag: 'M',
                value: length.into(),
            })?;
            PgOutputMessage::Message(Message {
                transactional: flags & 1 == 1,
                prefix,
                content: reader.take(length)?,
            })
        }
        other => PgOutputMessage::Skipped(other),
    };
    Ok(message)
}

struct Reader {
    data: Bytes,
    offset: usize,
    tag: u8,
}

impl Reader {
    fn take(&mut self, len: usize) -> Result<Bytes, DecodeError> {
        let available = self.data.len() - self.offset;
        if available < len {
            return Err(DecodeError::Truncated {
                tag: self.tag as char,
                needed: len - available,
                offset: self.offset,
            });
        }
        let bytes = self.data.slice(self.offset..self.offset + len);
        self.offset += len;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?.get_u8())
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(self.take(4)?.get_u32())
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(self.take(8)?.get_u64())
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(self.take(8)?.get_i64())
    }

    fn count(&mut self) -> Result<usize, DecodeError> {
        let value = self.take(2)?.get_i16();
        usize::try_from(value).map_err(|_| DecodeError::NegativeLength {
            tag: self.tag as char,
            value: value.into(),
        })
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let tag = self.tag as char;
        let rest = &self.data[self.offset..];
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString { tag })?;
        let text = std::str::from_utf8(&rest[..len])
            .map_err(|_| DecodeError::NotUtf8 { tag })?
            .to_string();
        self.offset += len + 1;
        Ok(text)
    }

    fn column_value(&mut self) -> Result<ColumnValue, DecodeError> {
        match self.u8()? {
            b'n' => Ok(ColumnValue::Null),
            b'u' => Ok(ColumnValue::UnchangedToast),
            b't' => {
                let len = self.take(4)?.get_i32();
                let len = usize::try_from(len).map_err(|_| DecodeError::NegativeLength {
                    tag: self.tag as char,
                    value: len.into(),
                })?;
                Ok(ColumnValue::Text(self.take(len)?))
            }
            kind => Err(DecodeError::UnknownColumnKind {
                tag: self.tag as char,
                kind: kind as char,
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A Relation message of `public.<name>` whose columns are all `text`.
    pub(crate) fn relation(id: u32, name: &str, columns: &[&str]) -> Relation {
        Relation {
            id,
            namespace: "public".into(),
            name: name.into(),
            columns: columns
                .iter()
                .map(|n| RelationColumn {
                    name: n.to_string(),
                    type_oid: 25,
                })
                .collect(),
        }
    }

    /// A column value in the text format.
    pub(crate) fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    // Messages built field by field so each test documents the layout; `captured_*` tests below use bytes
    // captured from a real PostgreSQL 15 server.
    fn begin_bytes() -> Vec<u8> {
        let mut b = vec![b'B'];
        b.extend_from_slice(&0x0000_0000_0153_E2F8u64.to_be_bytes());
        b.extend_from_slice(&847_000_000_000_000i64.to_be_bytes());
        b.extend_from_slice(&742u32.to_be_bytes());
        b
    }

    fn relation_bytes() -> Vec<u8> {
        let mut b = vec![b'R'];
        b.extend_from_slice(&16390u32.to_be_bytes());
        b.extend_from_slice(b"public\0outbox_event\0d");
        b.extend_from_slice(&2i16.to_be_bytes());
        b.push(1);
        b.extend_from_slice(b"event_id\0");
        b.extend_from_slice(&2950u32.to_be_bytes());
        b.extend_from_slice(&(-1i32).to_be_bytes());
        b.push(0);
        b.extend_from_slice(b"payload\0");
        b.extend_from_slice(&3802u32.to_be_bytes());
        b.extend_from_slice(&(-1i32).to_be_bytes());
        b
    }

    fn insert_bytes() -> Vec<u8> {
        let mut b = vec![b'I'];
        b.extend_from_slice(&16390u32.to_be_bytes());
        b.push(b'N');
        b.extend_from_slice(&3i16.to_be_bytes());
        b.push(b't');
        b.extend_from_slice(&4i32.to_be_bytes());
        b.extend_from_slice(b"abcd");
        b.push(b'n');
        b.push(b'u');
        b
    }

    /// One transaction captured from PostgreSQL 15 with
    /// `pg_logical_slot_peek_binary_changes(slot, NULL, NULL, 'proto_version', '1', 'publication_names', 'outboxd')`
    /// after inserting one row into the standard outbox table.
    pub(crate) const CAPTURED_PG15: [&str; 4] = [
        "4200000000015132b800030476364782d5000002d5",
        "52000040087075626c6963006f7574626f785f6576656e740064000b016576656e745f69640000000b86ffffffff006167677265676174655f747970650000000019ffffffff006167677265676174655f69640000000019ffffffff006576656e745f747970650000000019ffffffff007061796c6f61640000000edaffffffff00637265617465645f617400000004a0ffffffff00617661696c61626c655f617400000004a0ffffffff00617474656d7074730000000017ffffffff006c656173655f746f6b656e0000000b86ffffffff006c656173655f756e74696c00000004a0ffffffff007075626c69736865645f617400000004a0ffffffff",
        "49000040084e000b740000002430623764366630652d386633632d346331622d396436652d31663261336234633564366574000000054f7264657274000000076f726465722d31740000000c4f7264657243726561746564740000000f7b22746f74616c223a2031322e357d740000001d323032362d31312d33302030353a31313a33332e3433353733342b3030740000001d323032362d31312d33302030353a31313a33332e3433353733342b30307400000001306e6e6e",
        "430000000000015132b800000000015132e800030476364782d5",
    ];

    pub(crate) fn unhex(text: &str) -> Bytes {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect::<Vec<u8>>()
            .into()
    }

    #[test]
    fn decodes_a_captured_pg15_transaction() {
        let messages: Vec<_> = CAPTURED_PG15
            .iter()
            .map(|hex| decode(unhex(hex)).unwrap())
            .collect();
        let PgOutputMessage::Begin(begin) = &messages[0] else {
            panic!("{:?}", messages[0])
        };
        assert_eq!(begin.final_lsn, "0/15132B8".parse().unwrap());
        assert_eq!(begin.xid, 725);
        let PgOutputMessage::Relation(relation) = &messages[1] else {
            panic!("{:?}", messages[1])
        };
        assert_eq!(
            (relation.namespace.as_str(), relation.name.as_str()),
            ("public", "outbox_event")
        );
        assert_eq!(relation.columns.len(), 11);
        assert_eq!(relation.columns[0].name, "event_id");
        assert_eq!(relation.columns[0].type_oid, 2950);
        let PgOutputMessage::Insert(insert) = &messages[2] else {
            panic!("{:?}", messages[2])
        };
        assert_eq!(insert.relation_id, relation.id);
        assert_eq!(
            insert.values[3],
            ColumnValue::Text(Bytes::from_static(b"OrderCreated"))
        );
        assert_eq!(insert.values[10], ColumnValue::Null);
        let PgOutputMessage::Commit(commit) = &messages[3] else {
            panic!("{:?}", messages[3])
        };
        assert_eq!(commit.commit_lsn, begin.final_lsn);
        assert_eq!(commit.end_lsn, "0/15132E8".parse().unwrap());
    }

    #[test]
    fn decodes_begin() {
        let msg = decode(Bytes::from(begin_bytes())).unwrap();
        assert_eq!(
            msg,
            PgOutputMessage::Begin(Begin {
                final_lsn: Lsn(0x153_E2F8),
                commit_time_micros: 847_000_000_000_000,
                xid: 742
            })
        );
    }

    #[test]
    fn decodes_commit() {
        let mut b = vec![b'C', 0];
        b.extend_from_slice(&10u64.to_be_bytes());
        b.extend_from_slice(&20u64.to_be_bytes());
        b.extend_from_slice(&30i64.to_be_bytes());
        let msg = decode(Bytes::from(b)).unwrap();
        assert_eq!(
            msg,
            PgOutputMessage::Commit(Commit {
                commit_lsn: Lsn(10),
                end_lsn: Lsn(20),
                commit_time_micros: 30
            })
        );
    }

    #[test]
    fn decodes_relation_columns_by_name() {
        let PgOutputMessage::Relation(rel) = decode(Bytes::from(relation_bytes())).unwrap() else {
            panic!("not a relation")
        };
        assert_eq!(rel.id, 16390);
        assert_eq!(rel.namespace, "public");
        assert_eq!(rel.name, "outbox_event");
        let names: Vec<_> = rel.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["event_id", "payload"]);
        assert_eq!(rel.columns[1].type_oid, 3802);
    }

    #[test]
    fn decodes_insert_values() {
        let PgOutputMessage::Insert(insert) = decode(Bytes::from(insert_bytes())).unwrap() else {
            panic!("not an insert")
        };
        assert_eq!(insert.relation_id, 16390);
        assert_eq!(
            insert.values,
            vec![
                ColumnValue::Text(Bytes::from_static(b"abcd")),
                ColumnValue::Null,
                ColumnValue::UnchangedToast
            ]
        );
    }

    #[test]
    fn decodes_a_logical_decoding_message() {
        let mut bytes = vec![b'M', 1];
        bytes.extend_from_slice(&0x10u64.to_be_bytes());
        bytes.extend_from_slice(b"outboxd.handoff\0");
        bytes.extend_from_slice(&3i32.to_be_bytes());
        bytes.extend_from_slice(b"abc");
        assert_eq!(
            decode(Bytes::from(bytes)).unwrap(),
            PgOutputMessage::Message(Message {
                transactional: true,
                prefix: "outboxd.handoff".into(),
                content: Bytes::from_static(b"abc"),
            })
        );
    }

    #[test]
    fn skips_other_message_types() {
        for tag in [b'U', b'D', b'T', b'O', b'Y', b'S', b'E'] {
            assert_eq!(
                decode(Bytes::from(vec![tag, 1, 2, 3])).unwrap(),
                PgOutputMessage::Skipped(tag)
            );
        }
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        for full in [begin_bytes(), relation_bytes(), insert_bytes()] {
            for cut in 0..full.len() {
                assert!(
                    decode(Bytes::copy_from_slice(&full[..cut])).is_err(),
                    "cut at {cut} of {:?}",
                    full[0]
                );
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A small deterministic fuzz: xorshift-generated inputs starting with each interesting tag.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000 {
            let len = (next() % 64) as usize;
            let mut data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Some(first) = data.first_mut() {
                *first = [b'B', b'C', b'R', b'I', b'U'][round % 5];
            }
            let _ = decode(Bytes::from(data));
        }
    }

    #[test]
    fn rejects_bad_inputs_with_named_errors() {
        assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
        let mut bad_kind = insert_bytes();
        let len = bad_kind.len();
        bad_kind[len - 1] = b'x';
        assert_eq!(
            decode(Bytes::from(bad_kind)),
            Err(DecodeError::UnknownColumnKind {
                tag: 'I',
                kind: 'x'
            })
        );
        let mut bad_marker = insert_bytes();
        bad_marker[5] = b'K';
        assert_eq!(
            decode(Bytes::from(bad_marker)),
            Err(DecodeError::BadTupleMarker('K'))
        );
    }
}
