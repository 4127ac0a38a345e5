//! Shipping quotes from several carriers at once: a scatter-gather.
//!
//! The order page offers a quote from every carrier shipping works with.
//! One carrier (`slowboat`) is slow: it answers in 2 s, long after anyone
//! reading the page has stopped waiting. The shop asks all of them under a
//! 250 ms budget (or less, when the caller's deadline is closer), answers
//! with the quotes that arrived, and says which carriers are missing and
//! why, instead of failing the page or pretending the list is complete.
//! Each carrier is behind its own breaker, from the shop's registry
//! (`shipping-quote/<carrier>`), so the slow carrier stops being asked
//! after it ran out the budget a few times, and the page stops waiting
//! for it at all.

use std::time::Duration;

use keel_client::{HttpCallError, PropagatingClient};
use keel_core::{Classified, Classify, ErrorClass, PolicyError, Rejected};
use keel_policy::ConfigError;
use keel_policy::breaker::BreakerRegistry;
use keel_policy::scatter_gather::{Gathered, ScatterGather};

use super::model::{MissingCarrier, ShippingQuote, ShippingQuotes};
use super::saga::classified;

/// The carriers shipping asks, in the order their quotes are listed.
pub const CARRIERS: [&str; 3] = ["fastship", "parcelco", "slowboat"];
/// The carrier that is always slow.
pub const SLOW_CARRIER: &str = "slowboat";
/// How long `slowboat` takes to answer.
pub const SLOW_CARRIER_DELAY: Duration = Duration::from_secs(2);
/// The most the order page waits for quotes.
pub const QUOTE_BUDGET: Duration = Duration::from_millis(250);
/// The name of the gather: its metrics and its breakers'.
pub const GATHER: &str = "shipping-quote";

/// Asks every carrier for a quote, through shipping.
#[derive(Debug, Clone)]
pub struct CarrierQuotes {
    client: PropagatingClient,
    url: String,
    gather: ScatterGather,
}

impl CarrierQuotes {
    /// Quotes from shipping at `shipping_url`, each carrier's breaker from
    /// `breakers`.
    pub fn new(
        client: PropagatingClient,
        shipping_url: &str,
        breakers: &BreakerRegistry,
    ) -> Result<Self, ConfigError> {
        let gather = CARRIERS
            .iter()
            .fold(ScatterGather::builder(GATHER), |b, carrier| {
                b.target(*carrier)
            })
            .breakers(breakers.clone())
            .budget(QUOTE_BUDGET)
            .build()?;
        Ok(Self {
            client,
            url: format!("{shipping_url}/carriers"),
            gather,
        })
    }

    /// What each carrier asks to ship `customer`'s order, as far as the
    /// carriers answer in time.
    pub async fn for_customer(&self, customer: &str) -> ShippingQuotes {
        let gathered = self
            .gather
            .call(|carrier| self.ask(carrier, customer))
            .await;
        answer(gathered)
    }

    async fn ask(
        &self,
        carrier: keel_core::Name,
        customer: &str,
    ) -> Result<ShippingQuote, QuoteError> {
        let url = format!("{}/{carrier}/quotes/{customer}", self.url);
        let response = self
            .client
            .send(self.client.inner().get(url))
            .await
            .map_err(|e| match e {
                // The client's timeout is the gather's budget (its deadline).
                HttpCallError::Timeout { .. } => QuoteError::TooSlow(e),
                other => QuoteError::Failed(classified(other)),
            })?;
        response
            .json::<ShippingQuote>()
            .await
            .map_err(|e| QuoteError::Failed(Classified::new(ErrorClass::Retryable, e)))
    }
}

/// Why a carrier's quote did not come.
#[derive(Debug, thiserror::Error)]
enum QuoteError {
    /// It did not answer before the budget ended.
    #[error("the carrier did not answer within the budget")]
    TooSlow(#[source] HttpCallError),
    /// It answered with an error, or could not be reached.
    #[error(transparent)]
    Failed(Classified),
}

impl Classify for QuoteError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::TooSlow(_) => ErrorClass::OutcomeUnknown,
            Self::Failed(e) => e.class(),
        }
    }
}

fn answer(gathered: Gathered<ShippingQuote, QuoteError>) -> ShippingQuotes {
    let missing = gathered
        .missing
        .iter()
        .map(|m| MissingCarrier {
            carrier: m.target.to_string(),
            reason: reason(&m.error).to_owned(),
        })
        .collect();
    ShippingQuotes {
        partial: gathered.is_partial(),
        quotes: gathered.values().collect(),
        missing,
    }
}

/// Why a carrier is missing, as the page says it.
fn reason(error: &PolicyError<QuoteError>) -> &'static str {
    match error {
        PolicyError::Inner(QuoteError::TooSlow(_)) => "too_slow",
        PolicyError::Inner(QuoteError::Failed(_)) => "failed",
        PolicyError::Rejected(Rejected::Timeout { .. }) => "too_slow",
        PolicyError::Rejected(rejected) => rejected.kind(),
    }
}
