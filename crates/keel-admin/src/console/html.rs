//! HTML escaping and URL path encoding: everything shown on the console
//! comes from messages, errors and ids that an attacker may have chosen, so
//! nothing reaches the page without going through [`escape`].

use std::fmt::Write as _;

/// `text` with `& < > " '` replaced by entities, safe in element content
/// and in quoted attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `segment` percent-encoded for one URL path segment (a dead letter id may
/// hold `/`, `?` or `#`).
pub(crate) fn encode_segment(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:@".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A POST form with one button, the console's only kind of action: it
/// works without JavaScript and the server answers `303` back to the page.
pub(crate) fn action_button(
    path: &str,
    action: &str,
    label: &str,
    data: &[(&str, &str)],
    confirm: Option<&str>,
) -> String {
    let mut attrs = String::new();
    for (name, value) in data {
        let _ = write!(attrs, " data-{name}=\"{}\"", escape(value));
    }
    let confirm = confirm
        .map(|q| format!(" data-confirm=\"{}\"", escape(q)))
        .unwrap_or_default();
    format!(
        "<form class=\"action\" method=\"post\" action=\"{}\"{confirm}>\
         <button type=\"submit\" data-action=\"{}\"{attrs}>{}</button></form>",
        escape(path),
        escape(action),
        escape(label)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_text_cannot_become_markup() {
        assert_eq!(
            escape(r#"<script>alert("x")</script> & 'y'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        assert_eq!(
            encode_segment("billing:evt/1?a#b c"),
            "billing:evt%2F1%3Fa%23b%20c"
        );
        let form = action_button("/x/\"y", "replay", "<b>", &[("id", "a\"b")], None);
        assert!(form.contains("action=\"/x/&quot;y\""));
        assert!(form.contains("data-id=\"a&quot;b\""));
        assert!(form.contains("&lt;b&gt;"));
    }
}
