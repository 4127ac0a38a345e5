//! The demo's progress on stderr, fitted to where it goes: on a terminal
//! one line redrawn in place; in a file or a CI log a plain line every few
//! seconds and the last one, so the output reads line by line instead of
//! as hundreds of `\r`-joined updates.

use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use keel_core::clock::Instant;
use parking_lot::Mutex;

/// How often a plain line is printed when stderr is not a terminal.
pub const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// One progress line, shared by whoever updates it.
#[derive(Debug)]
pub struct ProgressLine {
    in_place: bool,
    printed: Mutex<Printed>,
}

#[derive(Debug, Default)]
struct Printed {
    at: Option<Instant>,
    text: String,
    pending: Option<String>,
}

impl ProgressLine {
    /// Redraws in place if stderr is a terminal.
    pub fn for_stderr() -> Self {
        Self::new(std::io::stderr().is_terminal())
    }

    fn new(in_place: bool) -> Self {
        Self {
            in_place,
            printed: Mutex::default(),
        }
    }

    /// Shows `text` now (in place), or when a plain line is due.
    pub fn show(&self, text: String) {
        let mut out = std::io::stderr().lock();
        if let Some(line) = self.line(text, keel_core::clock::now()) {
            let _ = out.write_all(line.as_bytes());
            let _ = out.flush();
        }
    }

    /// Ends the line: a newline after the in-place line, or the last
    /// update if it was not printed yet.
    pub fn finish(&self) {
        let mut out = std::io::stderr().lock();
        let _ = out.write_all(self.last_line().as_bytes());
    }

    /// What to write for `text` at `now`, if anything.
    fn line(&self, text: String, now: Instant) -> Option<String> {
        if self.in_place {
            return Some(format!("\r\x1b[2K{text}"));
        }
        let mut printed = self.printed.lock();
        let due = printed
            .at
            .is_none_or(|at| now.saturating_duration_since(at) >= PLAIN_EVERY);
        if !due || printed.text == text {
            printed.pending = (printed.text != text).then_some(text);
            return None;
        }
        printed.at = Some(now);
        printed.text.clone_from(&text);
        printed.pending = None;
        Some(text + "\n")
    }

    fn last_line(&self) -> String {
        if self.in_place {
            return "\n".to_owned();
        }
        let mut printed = self.printed.lock();
        match printed.pending.take() {
            Some(text) => text + "\n",
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_a_terminal_a_plain_line_comes_every_few_seconds_and_the_last_one_at_the_end() {
        let line = ProgressLine::new(false);
        let start = keel_core::clock::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut written = String::new();
        for (i, ms) in (0..40).map(|i| (i, i * 250)) {
            if let Some(text) = line.line(format!("sent {i}"), at(ms)) {
                written.push_str(&text);
            }
        }
        written.push_str(&line.last_line());
        assert_eq!(written, "sent 0\nsent 20\nsent 39\n");
        assert!(!written.contains('\r'));
    }

    #[test]
    fn on_a_terminal_every_update_redraws_the_line() {
        let line = ProgressLine::new(true);
        let now = keel_core::clock::now();
        assert_eq!(line.line("a".into(), now).unwrap(), "\r\x1b[2Ka");
        assert_eq!(line.line("b".into(), now).unwrap(), "\r\x1b[2Kb");
        assert_eq!(line.last_line(), "\n");
    }

    #[test]
    fn an_unchanged_line_is_not_printed_again() {
        let line = ProgressLine::new(false);
        let start = keel_core::clock::now();
        assert!(line.line("same".into(), start).is_some());
        assert!(line.line("same".into(), start + PLAIN_EVERY).is_none());
        assert_eq!(line.last_line(), "");
    }
}
