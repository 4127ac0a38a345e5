//! The breaker's states, its transitions, and the packed atomic word that
//! holds the current one.

use keel_core::Name;
use keel_core::clock::Instant;
use serde::{Deserialize, Serialize};

/// Where a circuit breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Calls go through and their outcomes are recorded.
    Closed,
    /// Calls are refused until the open duration has passed.
    Open,
    /// A few probe calls go through; the rest are refused.
    HalfOpen,
    /// Calls are refused until an operator resets the breaker.
    ForcedOpen,
    /// Calls go through and are recorded, but the breaker never opens.
    Disabled,
}

impl State {
    /// Every state, in gauge order.
    pub const ALL: [State; 5] = [
        State::Closed,
        State::Open,
        State::HalfOpen,
        State::ForcedOpen,
        State::Disabled,
    ];

    /// A short stable name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
            Self::ForcedOpen => "forced_open",
            Self::Disabled => "disabled",
        }
    }

    /// The value of the `keel_breaker_state` gauge: closed 0, open 1,
    /// half-open 2, forced open 3, disabled 4.
    pub fn gauge_value(self) -> f64 {
        f64::from(self.index())
    }

    pub(super) fn index(self) -> u8 {
        match self {
            Self::Closed => 0,
            Self::Open => 1,
            Self::HalfOpen => 2,
            Self::ForcedOpen => 3,
            Self::Disabled => 4,
        }
    }

    fn from_index(index: u8) -> Self {
        match index {
            1 => Self::Open,
            2 => Self::HalfOpen,
            3 => Self::ForcedOpen,
            4 => Self::Disabled,
            _ => Self::Closed,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A change of a breaker's state, as sent to
/// [`subscribe`](super::CircuitBreaker::subscribe)rs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateTransition {
    /// The breaker's name.
    pub name: Name,
    /// The state it left.
    pub from: State,
    /// The state it entered.
    pub to: State,
    /// When (tokio's clock).
    pub at: Instant,
}

/// The current state, its generation and the half-open probe counts, packed
/// into one `u64` so that one atomic load answers "may this call go?" and one
/// compare-and-swap hands out a probe slot without a race.
///
/// Layout: bits 0..7 state, bit 7 "cooling", 8..24 probes issued, 24..40
/// probes succeeded, 40..64 generation. The generation grows with every
/// transition, so an outcome from an earlier state (a call let through
/// before the breaker opened) is recognised as stale and not counted.
/// "Cooling" is set on an open word while the cool-down timer has not fired:
/// no probe can be due yet, so a refusal need not read the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Word(pub(super) u64);

const STATE_MASK: u64 = 0x7F;
const COOLING: u64 = 0x80;
const ISSUED_SHIFT: u32 = 8;
const SUCCEEDED_SHIFT: u32 = 24;
const GENERATION_SHIFT: u32 = 40;
const GENERATION_MASK: u32 = 0x00FF_FFFF;

impl Word {
    pub(super) fn new(state: State, generation: u32) -> Self {
        let generation = u64::from(generation & GENERATION_MASK);
        Self(u64::from(state.index()) | generation << GENERATION_SHIFT)
    }

    pub(super) fn state(self) -> State {
        State::from_index((self.0 & STATE_MASK) as u8)
    }

    #[inline]
    pub(super) fn cooling(self) -> bool {
        self.0 & COOLING != 0
    }

    pub(super) fn with_cooling(self, cooling: bool) -> Self {
        match cooling {
            true => Self(self.0 | COOLING),
            false => Self(self.0 & !COOLING),
        }
    }

    pub(super) fn generation(self) -> u32 {
        (self.0 >> GENERATION_SHIFT) as u32 & GENERATION_MASK
    }

    pub(super) fn next_generation(self) -> u32 {
        self.generation().wrapping_add(1) & GENERATION_MASK
    }

    pub(super) fn issued(self) -> u16 {
        (self.0 >> ISSUED_SHIFT) as u16
    }

    pub(super) fn succeeded(self) -> u16 {
        (self.0 >> SUCCEEDED_SHIFT) as u16
    }

    pub(super) fn with_issued(self, issued: u16) -> Self {
        Self(self.0 & !(0xFFFF << ISSUED_SHIFT) | u64::from(issued) << ISSUED_SHIFT)
    }

    pub(super) fn with_succeeded(self, succeeded: u16) -> Self {
        Self(self.0 & !(0xFFFF << SUCCEEDED_SHIFT) | u64::from(succeeded) << SUCCEEDED_SHIFT)
    }

    /// Same state entered by the same transition (probe counts may differ).
    pub(super) fn same_epoch(self, other: Word) -> bool {
        self.generation() == other.generation() && self.state() == other.state()
    }
}
