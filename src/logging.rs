//! Log output that keeps data as data: text logs and the final `error:` line carry values that come from
//! outbox rows and from servers (aggregate ids, broker and PostgreSQL messages), so their control characters
//! are escaped and a value can never start a forged log line (security review L3). Owns the text format's
//! field formatting; the JSON format escapes by itself. Not where log levels or filters are decided.

use std::borrow::Cow;
use std::fmt::Write as _;

use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::{self, FormatFields, Writer};

/// `text` with every control character (CR and LF included, which tracing-subscriber leaves as they are)
/// written as an escape: `\n`, `\r`, `\t`, or `\u{..}`.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            let _ = write!(escaped, "{}", c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    Cow::Owned(escaped)
}

/// The text format's fields: `name=value` separated by spaces, the message bare, every value escaped.
pub fn text_fields() -> impl for<'writer> FormatFields<'writer> + Send + Sync + 'static {
    format::debug_fn(|writer: &mut Writer<'_>, field, value| {
        let text = format!("{value:?}");
        let text = escape_controls(&text);
        if field.name() == "message" {
            write!(writer, "{text}")
        } else {
            write!(writer, "{}={text}", field.name())
        }
    })
    .delimited(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(escape_controls("order-1"), "order-1");
        assert_eq!(
            escape_controls("x\n2026-12-03T00:00:00Z  INFO outboxd: all events published\r"),
            "x\\n2026-12-03T00:00:00Z  INFO outboxd: all events published\\r"
        );
        assert_eq!(escape_controls("a\u{1b}[31mred"), "a\\u{1b}[31mred");
        assert_eq!(escape_controls("é ünïcode"), "é ünïcode");
    }
}
