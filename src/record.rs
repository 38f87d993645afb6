//! What a Kafka record of an outbox event holds besides its key (the aggregate id): its headers and value,
//! in outboxd's own format (the payload as is, the event's fields as headers) or as a CloudEvent in the
//! CloudEvents 1.0 Kafka protocol binding (`--format cloudevents`), binary or structured content mode.
//! Pure; the publisher (`kafka`) sends what it builds, the topic comes from `topic`.

use std::borrow::Cow;

use base64::Engine;

use crate::event::OutboxEvent;
use crate::table::{OutboxTable, PayloadType, TableName};

/// How records are written (`--format`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RecordFormat {
    /// The payload as the value; event id, type, aggregate type, created_at and `--header-column`s as
    /// headers.
    #[default]
    Outboxd,
    /// A CloudEvent (`--format cloudevents`).
    CloudEvents(CloudEventsFormat),
}

/// `--format cloudevents`: the content mode and where `source` comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEventsFormat {
    /// `--cloudevents-mode`.
    pub mode: ContentMode,
    /// `--cloudevents-source`.
    pub source: SourceTemplate,
}

/// The CloudEvents Kafka binding's content modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentMode {
    /// Attributes as `ce_` headers, the data as the value, its media type in `content-type`.
    #[default]
    Binary,
    /// The whole event as a JSON object in the value (`content-type: application/cloudevents+json`).
    Structured,
}

/// A record's headers and value, borrowing from the event where they can.
#[derive(Debug, PartialEq, Eq)]
pub struct RecordParts<'a> {
    /// Header name and value, in order.
    pub headers: Vec<(Cow<'a, str>, Cow<'a, [u8]>)>,
    /// `None`: a tombstone (a NULL payload).
    pub value: Option<Cow<'a, [u8]>>,
}

/// The CloudEvents spec version outboxd writes.
const SPEC_VERSION: &str = "1.0";
/// `type` for an event whose row has neither an event type nor an aggregate type.
const FALLBACK_TYPE: &str = "outboxd.event";

/// The header of a record that republishes an event already published (`outboxd replay --published`, or
/// `outboxd audit --heal`): the replay's id, in every format, so that consumers and `audit` can tell.
pub const REPLAY_HEADER: &str = "outboxd-replay";

impl RecordFormat {
    /// The headers and value of `event`'s record. `event_id_header` names outboxd's event id header
    /// (`event_id`, or `id` for Debezium-style tables); `error` adds an `error` header (dead letters).
    pub fn parts<'a>(
        &self,
        table: &OutboxTable,
        event: &'a OutboxEvent,
        event_id_header: &'static str,
        error: Option<&'a str>,
    ) -> RecordParts<'a> {
        let mut parts = match self {
            RecordFormat::Outboxd => outboxd_parts(event, event_id_header),
            RecordFormat::CloudEvents(format) => format.parts(table, event),
        };
        if let Some(error) = error {
            parts
                .headers
                .push((Cow::Borrowed("error"), Cow::Borrowed(error.as_bytes())));
        }
        if let Some(replay) = &event.replay {
            parts.headers.push(header(REPLAY_HEADER, replay));
        }
        parts
    }
}

fn header<'a>(name: &'a str, value: &'a str) -> (Cow<'a, str>, Cow<'a, [u8]>) {
    (Cow::Borrowed(name), Cow::Borrowed(value.as_bytes()))
}

fn outboxd_parts<'a>(event: &'a OutboxEvent, event_id_header: &'static str) -> RecordParts<'a> {
    let headers = [(event_id_header, event.event_id.as_str())]
        .into_iter()
        .chain(event.event_type.as_deref().map(|t| ("event_type", t)))
        .chain(
            event
                .aggregate_type
                .as_deref()
                .map(|t| ("aggregate_type", t)),
        )
        .chain(event.created_at.as_deref().map(|c| ("created_at", c)))
        .chain(event.headers.iter().map(|(k, v)| (&**k, v.as_str())))
        .map(|(name, value)| header(name, value))
        .collect();
    RecordParts {
        headers,
        value: event.payload.as_deref().map(Cow::Borrowed),
    }
}

/// The media type of a table's payload column.
fn data_content_type(payload: PayloadType) -> &'static str {
    match payload {
        PayloadType::Json => "application/json",
        PayloadType::Text => "text/plain; charset=utf-8",
        PayloadType::Bytes => "application/octet-stream",
    }
}

impl CloudEventsFormat {
    fn parts<'a>(&self, table: &OutboxTable, event: &'a OutboxEvent) -> RecordParts<'a> {
        let source = self.source.render(&table.name, event);
        let kind = event
            .event_type
            .as_deref()
            .or(event.aggregate_type.as_deref())
            .unwrap_or(FALLBACK_TYPE);
        let content_type = data_content_type(table.payload_type);
        match self.mode {
            ContentMode::Binary => {
                let mut headers = vec![
                    header("ce_specversion", SPEC_VERSION),
                    header("ce_id", event.event_id.as_str()),
                    (Cow::Borrowed("ce_source"), Cow::Owned(source.into_bytes())),
                    header("ce_type", kind),
                    header("ce_subject", event.aggregate_id.as_str()),
                ];
                if let Some(time) = event.created_at.as_deref() {
                    headers.push(header("ce_time", time));
                }
                if event.payload.is_some() {
                    headers.push(header("content-type", content_type));
                }
                headers.extend(event.headers.iter().map(|(name, value)| {
                    (
                        Cow::Owned(format!("ce_{name}")),
                        Cow::Borrowed(value.as_bytes()),
                    )
                }));
                RecordParts {
                    headers,
                    value: event.payload.as_deref().map(Cow::Borrowed),
                }
            }
            ContentMode::Structured => {
                let mut object = serde_json::Map::new();
                let mut put = |name: &str, value: serde_json::Value| {
                    object.insert(name.to_string(), value);
                };
                put("specversion", SPEC_VERSION.into());
                put("id", event.event_id.as_str().into());
                put("source", source.into());
                put("type", kind.into());
                put("subject", event.aggregate_id.as_str().into());
                if let Some(time) = event.created_at.as_deref() {
                    put("time", time.into());
                }
                for (name, value) in &event.headers {
                    put(name, value.as_str().into());
                }
                if let Some(payload) = &event.payload {
                    put("datacontenttype", content_type.into());
                    match table.payload_type {
                        // The server's JSON text; not valid JSON (cannot happen for json/jsonb) is
                        // carried as a string rather than lost.
                        PayloadType::Json => match serde_json::from_slice(payload) {
                            Ok(data) => put("data", data),
                            Err(_) => put("data", String::from_utf8_lossy(payload).into()),
                        },
                        PayloadType::Text => put("data", String::from_utf8_lossy(payload).into()),
                        PayloadType::Bytes => put(
                            "data_base64",
                            base64::engine::general_purpose::STANDARD
                                .encode(payload)
                                .into(),
                        ),
                    }
                }
                let value = serde_json::Value::Object(object).to_string().into_bytes();
                RecordParts {
                    headers: vec![header("content-type", "application/cloudevents+json")],
                    value: Some(Cow::Owned(value)),
                }
            }
        }
    }
}

/// CloudEvents' own attribute names (and `data`): a `--header-column` must not take one, or a row would
/// decide the event's id, source or type (security review L2).
pub const CLOUDEVENTS_RESERVED: [&str; 10] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
];

/// The headers outboxd's own format sets (the event id's as `event_id`, or `id` for Debezium-style
/// tables; `error` on dead letters): a `--header-column` must not take one.
pub const OUTBOXD_HEADERS: [&str; 6] = [
    "event_id",
    "id",
    "event_type",
    "aggregate_type",
    "created_at",
    "error",
];

/// Whether `name` may be a CloudEvents attribute name (lower-case ASCII letters and digits; the spec asks
/// for at most 20 characters): a `--header-column` becomes an extension attribute of that name.
pub fn is_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SourcePart {
    Literal(String),
    Schema,
    Table,
    AggregateType,
}

/// `--cloudevents-source`: a URI reference with `{schema}`, `{table}` and `{aggregate_type}` placeholders,
/// `/{schema}/{table}` by default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTemplate {
    parts: Vec<SourcePart>,
}

/// Why a `--cloudevents-source` cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SourceError {
    /// A `{name}` that is not a placeholder.
    #[error("--cloudevents-source {template:?}: unknown placeholder {{{name}}}; use {{schema}}, {{table}} or {{aggregate_type}}")]
    UnknownPlaceholder {
        /// The template as given.
        template: String,
        /// The name between the braces.
        name: String,
    },
    /// A `{` without its `}` or the reverse, or an empty template.
    #[error("--cloudevents-source {0:?}: empty, or an unbalanced '{{' or '}}'")]
    Malformed(String),
}

impl Default for SourceTemplate {
    fn default() -> Self {
        SourceTemplate {
            parts: vec![
                SourcePart::Literal("/".into()),
                SourcePart::Schema,
                SourcePart::Literal("/".into()),
                SourcePart::Table,
            ],
        }
    }
}

impl SourceTemplate {
    /// Parses a template, checking its placeholders.
    pub fn parse(template: &str) -> Result<Self, SourceError> {
        let malformed = || SourceError::Malformed(template.into());
        if template.is_empty() {
            return Err(malformed());
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(malformed());
            }
            let close = open + rest[open..].find('}').ok_or_else(malformed)?;
            if open > 0 {
                parts.push(SourcePart::Literal(rest[..open].into()));
            }
            parts.push(match &rest[open + 1..close] {
                "schema" => SourcePart::Schema,
                "table" => SourcePart::Table,
                "aggregate_type" => SourcePart::AggregateType,
                name => {
                    return Err(SourceError::UnknownPlaceholder {
                        template: template.into(),
                        name: name.into(),
                    })
                }
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(SourcePart::Literal(rest.into()));
        }
        Ok(SourceTemplate { parts })
    }

    /// Whether the template uses `{aggregate_type}`.
    pub fn uses_aggregate_type(&self) -> bool {
        self.parts.contains(&SourcePart::AggregateType)
    }

    /// The `source` of `event` from `table` (an absent aggregate type renders empty).
    pub fn render(&self, table: &TableName, event: &OutboxEvent) -> String {
        let mut source = String::with_capacity(48);
        for part in &self.parts {
            source.push_str(match part {
                SourcePart::Literal(text) => text,
                SourcePart::Schema => &table.schema,
                SourcePart::Table => &table.name,
                SourcePart::AggregateType => event.aggregate_type.as_deref().unwrap_or_default(),
            });
        }
        source
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn event() -> OutboxEvent {
        OutboxEvent {
            event_id: "0b7e7a4e-8f43-4d0e-9a57-5b1f0c0b5e11".into(),
            aggregate_type: Some("Order".into()),
            aggregate_id: "order-7".into(),
            event_type: Some("OrderConfirmed".into()),
            payload: Some(bytes::Bytes::from_static(br#"{"total": 12}"#)),
            created_at: Some("2026-12-03T07:00:00.123456Z".into()),
            headers: vec![(Arc::from("traceparent"), "00-abc-def-01".into())],
            replay: None,
        }
    }

    fn table(payload_type: PayloadType) -> OutboxTable {
        let mut table = OutboxTable::standard_for_tests();
        table.payload_type = payload_type;
        table
    }

    fn cloudevents(mode: ContentMode) -> RecordFormat {
        RecordFormat::CloudEvents(CloudEventsFormat {
            mode,
            source: SourceTemplate::default(),
        })
    }

    /// `format`'s record of `event` from a table whose payload column is `payload_type`.
    fn record<'a>(
        format: &RecordFormat,
        payload_type: PayloadType,
        event: &'a OutboxEvent,
    ) -> RecordParts<'a> {
        format.parts(&table(payload_type), event, "event_id", None)
    }

    fn pairs<const N: usize>(expected: [(&str, &str); N]) -> Vec<(String, String)> {
        expected
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .to_vec()
    }

    fn headers(parts: &RecordParts<'_>) -> Vec<(String, String)> {
        parts
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v).into_owned()))
            .collect()
    }

    #[test]
    fn outboxd_format_carries_the_fields_as_headers_and_the_payload_as_is() {
        let event = event();
        let parts = record(&RecordFormat::Outboxd, PayloadType::Json, &event);
        assert_eq!(
            headers(&parts),
            pairs([
                ("event_id", "0b7e7a4e-8f43-4d0e-9a57-5b1f0c0b5e11"),
                ("event_type", "OrderConfirmed"),
                ("aggregate_type", "Order"),
                ("created_at", "2026-12-03T07:00:00.123456Z"),
                ("traceparent", "00-abc-def-01"),
            ])
        );
        assert_eq!(parts.value.as_deref(), Some(&br#"{"total": 12}"#[..]));
    }

    #[test]
    fn a_republished_event_carries_its_replay_in_every_format() {
        let replayed = OutboxEvent {
            replay: Some("r-1".into()),
            ..event()
        };
        for format in [
            RecordFormat::Outboxd,
            cloudevents(ContentMode::Binary),
            cloudevents(ContentMode::Structured),
        ] {
            let parts = record(&format, PayloadType::Json, &replayed);
            assert!(
                headers(&parts).contains(&(REPLAY_HEADER.into(), "r-1".into())),
                "{format:?}"
            );
        }
        let original = event();
        let live = record(&RecordFormat::Outboxd, PayloadType::Json, &original);
        assert!(!headers(&live).iter().any(|(k, _)| k == REPLAY_HEADER));
    }

    #[test]
    fn binary_mode_maps_every_attribute_to_a_ce_header() {
        let event = event();
        let parts = cloudevents(ContentMode::Binary).parts(
            &table(PayloadType::Json),
            &event,
            "event_id",
            Some("refused"),
        );
        assert_eq!(
            headers(&parts),
            pairs([
                ("ce_specversion", "1.0"),
                ("ce_id", "0b7e7a4e-8f43-4d0e-9a57-5b1f0c0b5e11"),
                ("ce_source", "/public/outbox_event"),
                ("ce_type", "OrderConfirmed"),
                ("ce_subject", "order-7"),
                ("ce_time", "2026-12-03T07:00:00.123456Z"),
                ("content-type", "application/json"),
                ("ce_traceparent", "00-abc-def-01"),
                ("error", "refused"),
            ])
        );
        assert_eq!(parts.value.as_deref(), Some(&br#"{"total": 12}"#[..]));
    }

    #[test]
    fn structured_mode_puts_the_event_in_the_value() {
        let event = event();
        let parts = record(
            &cloudevents(ContentMode::Structured),
            PayloadType::Json,
            &event,
        );
        assert_eq!(
            headers(&parts),
            [(
                "content-type".to_string(),
                "application/cloudevents+json".to_string()
            )]
        );
        let value: serde_json::Value =
            serde_json::from_slice(parts.value.as_deref().unwrap()).unwrap();
        assert_eq!(
            value,
            serde_json::json!({
                "specversion": "1.0",
                "id": "0b7e7a4e-8f43-4d0e-9a57-5b1f0c0b5e11",
                "source": "/public/outbox_event",
                "type": "OrderConfirmed",
                "subject": "order-7",
                "time": "2026-12-03T07:00:00.123456Z",
                "traceparent": "00-abc-def-01",
                "datacontenttype": "application/json",
                "data": {"total": 12},
            })
        );
    }

    #[test]
    fn structured_mode_carries_text_as_a_string_and_bytes_as_base64() {
        let mut event = event();
        event.payload = Some(bytes::Bytes::from_static(b"\x00\xffhi"));
        let parts = record(
            &cloudevents(ContentMode::Structured),
            PayloadType::Bytes,
            &event,
        );
        let value: serde_json::Value =
            serde_json::from_slice(parts.value.as_deref().unwrap()).unwrap();
        assert_eq!(value["data_base64"], "AP9oaQ==");
        assert_eq!(value["datacontenttype"], "application/octet-stream");
        assert!(value.get("data").is_none());
        event.payload = Some(bytes::Bytes::from_static(b"plain words"));
        let parts = record(
            &cloudevents(ContentMode::Structured),
            PayloadType::Text,
            &event,
        );
        let value: serde_json::Value =
            serde_json::from_slice(parts.value.as_deref().unwrap()).unwrap();
        assert_eq!(value["data"], "plain words");
        assert_eq!(value["datacontenttype"], "text/plain; charset=utf-8");
    }

    #[test]
    fn a_null_payload_is_an_event_without_data() {
        let mut event = event();
        event.payload = None;
        let binary = record(&cloudevents(ContentMode::Binary), PayloadType::Json, &event);
        assert_eq!(binary.value, None, "binary mode keeps the tombstone");
        assert!(!headers(&binary).iter().any(|(k, _)| k == "content-type"));
        let structured = record(
            &cloudevents(ContentMode::Structured),
            PayloadType::Json,
            &event,
        );
        let value: serde_json::Value =
            serde_json::from_slice(structured.value.as_deref().unwrap()).unwrap();
        assert!(value.get("data").is_none() && value.get("datacontenttype").is_none());
    }

    #[test]
    fn type_falls_back_to_the_aggregate_type() {
        let mut event = event();
        event.event_type = None;
        let parts = record(&cloudevents(ContentMode::Binary), PayloadType::Json, &event);
        assert!(headers(&parts).contains(&("ce_type".into(), "Order".into())));
        event.aggregate_type = None;
        let parts = record(&cloudevents(ContentMode::Binary), PayloadType::Json, &event);
        assert!(headers(&parts).contains(&("ce_type".into(), FALLBACK_TYPE.into())));
    }

    #[test]
    fn source_templates_render_and_reject_unknown_placeholders() {
        let event = event();
        let name = TableName {
            schema: "sales".into(),
            name: "outbox".into(),
        };
        let template = SourceTemplate::parse("urn:shop:{schema}.{table}/{aggregate_type}").unwrap();
        assert_eq!(
            template.render(&name, &event),
            "urn:shop:sales.outbox/Order"
        );
        assert!(template.uses_aggregate_type());
        assert_eq!(
            SourceTemplate::parse("/orders")
                .unwrap()
                .render(&name, &event),
            "/orders"
        );
        assert_eq!(
            SourceTemplate::default().render(&name, &event),
            "/sales/outbox"
        );
        assert!(matches!(
            SourceTemplate::parse("/{tenant}"),
            Err(SourceError::UnknownPlaceholder { .. })
        ));
        for malformed in ["", "/{schema", "/}", "/{table}}"] {
            assert_eq!(
                SourceTemplate::parse(malformed),
                Err(SourceError::Malformed(malformed.into())),
                "{malformed:?}"
            );
        }
    }

    #[test]
    fn attribute_names_are_lower_case_letters_and_digits() {
        assert!(is_attribute_name("traceparent"));
        assert!(is_attribute_name("tenant2"));
        for bad in ["", "trace_id", "Tenant", "trace-id"] {
            assert!(!is_attribute_name(bad), "{bad:?}");
        }
    }
}
