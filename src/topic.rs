//! Topic templates: parse `outbox.{aggregate_type}`-style templates once, render a legal Kafka topic name
//! per event. Pure; owns nothing about the broker.

use crate::table::TableName;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    AggregateType,
    EventType,
    Schema,
    Table,
}

/// A parsed topic template. Placeholders: `{aggregate_type}`, `{event_type}`, and the outbox table's
/// `{schema}` and `{table}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicTemplate {
    parts: Vec<Part>,
}

/// Why a topic template cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TemplateError {
    /// A `{name}` that is not one of the placeholders.
    #[error("--topic {template:?}: unknown placeholder {{{name}}}; use {{aggregate_type}}, {{event_type}}, {{schema}} or {{table}}")]
    UnknownPlaceholder {
        /// The template as given.
        template: String,
        /// The unknown name between the braces.
        name: String,
    },
    /// A `{` without its `}`, or a `}` without a `{`; holds the template.
    #[error("--topic {0:?}: unbalanced '{{' or '}}'")]
    Unbalanced(String),
    /// The template's literal text holds a character Kafka does not allow in topic names.
    #[error("--topic {template:?}: character {ch:?} is not allowed in Kafka topic names (use letters, digits, '.', '_', '-')")]
    IllegalCharacter {
        /// The template as given.
        template: String,
        /// The first character Kafka does not allow, in the template's literal text.
        ch: char,
    },
    /// An empty template.
    #[error("--topic is empty")]
    Empty,
}

/// Longest topic name Kafka accepts.
const MAX_TOPIC_LEN: usize = 249;

fn is_legal_topic_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '-')
}

impl TopicTemplate {
    /// Parses a template, checking its placeholders and literal characters.
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        if template.is_empty() {
            return Err(TemplateError::Empty);
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                Some(at) if rest.as_bytes()[at] == b'}' => {
                    return Err(TemplateError::Unbalanced(template.into()))
                }
                Some(at) => {
                    push_literal(&mut parts, &rest[..at], template)?;
                    let close = rest[at..]
                        .find('}')
                        .ok_or_else(|| TemplateError::Unbalanced(template.into()))?;
                    let name = &rest[at + 1..at + close];
                    parts.push(match name {
                        "aggregate_type" => Part::AggregateType,
                        "event_type" => Part::EventType,
                        "schema" => Part::Schema,
                        "table" => Part::Table,
                        _ => {
                            return Err(TemplateError::UnknownPlaceholder {
                                template: template.into(),
                                name: name.into(),
                            })
                        }
                    });
                    rest = &rest[at + close + 1..];
                }
                None => {
                    push_literal(&mut parts, rest, template)?;
                    rest = "";
                }
            }
        }
        Ok(TopicTemplate { parts })
    }

    /// The topic of `event`, from outbox table `table` (an absent aggregate_type or event_type renders empty;
    /// start-up refuses templates that name a column a table lacks).
    pub fn render_event(&self, table: &TableName, event: &crate::event::OutboxEvent) -> String {
        self.render(
            table,
            event.aggregate_type.as_deref().unwrap_or_default(),
            event.event_type.as_deref().unwrap_or_default(),
        )
    }

    /// Whether the topic name starts with a row's value (`{aggregate_type}` or `{event_type}`): the rows then
    /// choose the whole name.
    pub fn starts_with_row_value(&self) -> bool {
        matches!(
            self.parts.first(),
            Some(Part::AggregateType | Part::EventType)
        )
    }

    /// Whether the template is one fixed name, with no placeholder.
    pub fn is_literal(&self) -> bool {
        self.parts
            .iter()
            .all(|part| matches!(part, Part::Literal(_)))
    }

    /// Whether the template uses `{aggregate_type}` / `{event_type}`.
    pub fn uses_aggregate_type(&self) -> bool {
        self.parts.contains(&Part::AggregateType)
    }

    /// Whether the template uses `{event_type}`.
    pub fn uses_event_type(&self) -> bool {
        self.parts.contains(&Part::EventType)
    }

    /// Whether `topic` is a name this template renders for `table` with some row values (each at least one
    /// character): how `outboxd doctor` finds the existing topics outboxd writes to.
    pub fn could_render(&self, table: &TableName, topic: &str) -> bool {
        // Literal text (the table's names filled in) and wildcards for the rows' values, in order.
        let mut pieces: Vec<Option<String>> = Vec::new();
        for part in &self.parts {
            pieces.push(match part {
                Part::Literal(text) => Some(text.clone()),
                Part::Schema => Some(table.schema.clone()),
                Part::Table => Some(table.name.clone()),
                Part::AggregateType | Part::EventType => None,
            });
        }
        fn matches(pieces: &[Option<String>], rest: &str) -> bool {
            match pieces.split_first() {
                None => rest.is_empty(),
                Some((Some(literal), more)) => rest
                    .strip_prefix(literal.as_str())
                    .is_some_and(|rest| matches(more, rest)),
                Some((None, more)) => rest
                    .char_indices()
                    .skip(1)
                    .map(|(at, _)| at)
                    .chain(std::iter::once(rest.len()).filter(|&end| end > 0))
                    .any(|at| matches(more, &rest[at..])),
            }
        }
        matches(&pieces, topic)
    }

    /// Renders the topic for one event. Characters Kafka does not allow in topic names are replaced by `_`
    /// (as Debezium does), so no event is ever unroutable; the name is cut at Kafka's 249-character limit.
    pub fn render(&self, table: &TableName, aggregate_type: &str, event_type: &str) -> String {
        let mut topic = String::with_capacity(64);
        for part in &self.parts {
            match part {
                Part::Literal(text) => topic.push_str(text),
                Part::AggregateType => push_sanitized(&mut topic, aggregate_type),
                Part::EventType => push_sanitized(&mut topic, event_type),
                Part::Schema => push_sanitized(&mut topic, &table.schema),
                Part::Table => push_sanitized(&mut topic, &table.name),
            }
        }
        if topic.is_empty() || topic == "." || topic == ".." {
            topic.push('_');
        }
        topic.truncate(MAX_TOPIC_LEN);
        topic
    }
}

fn push_literal(parts: &mut Vec<Part>, literal: &str, template: &str) -> Result<(), TemplateError> {
    if let Some(ch) = literal.chars().find(|&c| !is_legal_topic_char(c)) {
        return Err(TemplateError::IllegalCharacter {
            template: template.into(),
            ch,
        });
    }
    if !literal.is_empty() {
        parts.push(Part::Literal(literal.into()));
    }
    Ok(())
}

fn push_sanitized(topic: &mut String, value: &str) {
    topic.extend(
        value
            .chars()
            .map(|c| if is_legal_topic_char(c) { c } else { '_' }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(t: &TopicTemplate, aggregate_type: &str, event_type: &str) -> String {
        let table = TableName {
            schema: "billing".into(),
            name: "outbox".into(),
        };
        t.render(&table, aggregate_type, event_type)
    }

    #[test]
    fn renders_the_tables_schema_and_name() {
        let t = TopicTemplate::parse("{schema}.{table}.{aggregate_type}").unwrap();
        assert_eq!(render(&t, "Invoice", "e"), "billing.outbox.Invoice");
    }

    #[test]
    fn renders_placeholders() {
        let t = TopicTemplate::parse("outbox.{aggregate_type}").unwrap();
        assert_eq!(render(&t, "Order", "OrderCreated"), "outbox.Order");
        let t = TopicTemplate::parse("{aggregate_type}-{event_type}").unwrap();
        assert_eq!(render(&t, "Order", "Paid"), "Order-Paid");
        let t = TopicTemplate::parse("fixed").unwrap();
        assert_eq!(render(&t, "x", "y"), "fixed");
    }

    #[test]
    fn rejects_unknown_placeholders_and_bad_templates() {
        let err = TopicTemplate::parse("outbox.{aggregate}").unwrap_err();
        assert!(err.to_string().contains("{aggregate}"), "{err}");
        assert!(err.to_string().contains("{aggregate_type}"), "{err}");
        assert!(matches!(
            TopicTemplate::parse("a{b"),
            Err(TemplateError::Unbalanced(_))
        ));
        assert!(matches!(
            TopicTemplate::parse("a}b"),
            Err(TemplateError::Unbalanced(_))
        ));
        assert!(matches!(
            TopicTemplate::parse("a b"),
            Err(TemplateError::IllegalCharacter { ch: ' ', .. })
        ));
        assert_eq!(TopicTemplate::parse(""), Err(TemplateError::Empty));
    }

    #[test]
    fn sanitizes_values_into_legal_names() {
        let t = TopicTemplate::parse("outbox.{aggregate_type}").unwrap();
        assert_eq!(render(&t, "Order Line/ü", "e"), "outbox.Order_Line__");
        let t = TopicTemplate::parse("{aggregate_type}").unwrap();
        assert_eq!(render(&t, "", "e"), "_");
        assert_eq!(render(&t, "..", "e"), ".._");
        assert_eq!(render(&t, &"a".repeat(300), "e").len(), 249);
    }

    #[test]
    fn could_render_matches_the_names_a_template_makes_and_no_others() {
        let table = TableName {
            schema: "shop".into(),
            name: "outbox_event".into(),
        };
        let template = TopicTemplate::parse("outbox.{aggregate_type}").unwrap();
        assert!(template.could_render(&table, "outbox.Order"));
        assert!(
            !template.could_render(&table, "outbox."),
            "a row value is never empty"
        );
        assert!(!template.could_render(&table, "other.Order"));
        let template = TopicTemplate::parse("{schema}.{aggregate_type}.{event_type}").unwrap();
        assert!(template.could_render(&table, "shop.Order.Created"));
        assert!(template.could_render(&table, "shop.a.b.c"));
        assert!(!template.could_render(&table, "shop.Order"));
        assert!(!template.could_render(&table, "public.Order.Created"));
        let literal = TopicTemplate::parse("orders").unwrap();
        assert!(literal.could_render(&table, "orders"));
        assert!(!literal.could_render(&table, "orders2"));
    }
}
