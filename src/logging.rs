//! Log output that keeps data as data: text logs and the final `error:` line carry values that come from
//! outbox rows and from servers (aggregate ids, broker and PostgreSQL messages), so their control characters
//! are escaped and a value can never start a forged log line (security review L3). Owns the text format's
//! field formatting; the JSON format escapes by itself. Not where log levels or filters are decided.

use std::borrow::Cow;
use std::fmt::Write as _;

use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::{self, FormatFields, Writer};

/// `text` with every control character (CR and LF included, which tracing-subscriber leaves as they are),
/// every line or paragraph separator (U+2028, U+2029: line breaks to some log viewers) and every invisible
/// formatting character that reorders or hides text (bidi overrides, zero-width characters) written as an
/// escape: `\n`, `\r`, `\t`, or `\u{..}`.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if needs_escape(c) {
            let _ = write!(escaped, "{}", c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    Cow::Owned(escaped)
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}'
                | '\u{FEFF}'
        )
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

    #[test]
    fn line_separators_and_bidi_overrides_are_escaped() {
        assert_eq!(
            escape_controls("a\u{2028}b\u{2029}c"),
            "a\\u{2028}b\\u{2029}c"
        );
        assert_eq!(escape_controls("x\u{202E}gpj.exe"), "x\\u{202e}gpj.exe");
        assert_eq!(escape_controls("zero\u{200B}width"), "zero\\u{200b}width");
    }
}
