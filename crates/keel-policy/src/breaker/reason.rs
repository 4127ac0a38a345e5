//! Why a breaker changed state, in words for the log line that reports it.

use std::fmt;

use super::window::Tally;

/// Why a transition happened, for the log line that reports it.
#[derive(Debug)]
pub(super) enum Reason {
    FailureRate(Tally),
    SlowRate(Tally),
    Consecutive(u32),
    CoolDownElapsed,
    ProbeFailed,
    ProbeSlow,
    ProbesSucceeded(u16),
    ProbesUnanswered,
    Operator(&'static str),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::FailureRate(t) => {
                write!(f, "{} of the last {} calls failed", t.failures, t.calls)
            }
            Self::SlowRate(t) => write!(f, "{} of the last {} calls were slow", t.slow, t.calls),
            Self::Consecutive(run) => write!(f, "{run} calls failed in a row"),
            Self::CoolDownElapsed => f.write_str("the open duration has passed; probing"),
            Self::ProbeFailed => f.write_str("a probe call failed"),
            Self::ProbeSlow => f.write_str("a probe call was slow"),
            Self::ProbesSucceeded(n) => write!(f, "all {n} probe calls succeeded"),
            Self::ProbesUnanswered => {
                f.write_str("the probes did not answer within max_wait_in_half_open")
            }
            Self::Operator(what) => write!(f, "{what} by an operator"),
        }
    }
}
