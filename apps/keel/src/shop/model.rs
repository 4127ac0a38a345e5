//! The shop's domain types: an order as a client submits it, as it is
//! stored, and the event that announces it.
//!
//! Input is validated here, once, so every route that accepts an order
//! refuses the same things with the same words: a request can never put a
//! negative price or a thousand items into the database.

use keel_store::envelope::Event;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// The most items one order may hold.
pub const MAX_ITEMS: usize = 50;
/// The most units of one item.
pub const MAX_QTY: u32 = 1_000;
/// The highest unit price, in cents (one million dollars).
pub const MAX_UNIT_PRICE_CENTS: i64 = 100_000_000;
/// The longest customer id or sku.
pub const MAX_ID_LEN: usize = 64;
/// The largest request body the orders API reads, in bytes.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The demo fault a `POST /orders` may ask for with `X-Keel-Demo-Fault`
/// when the server runs with `--demo-faults`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum DemoFault {
    /// The `orders.placed` handler fails on every delivery of the original
    /// message, asking for the next one a second later, so it is
    /// dead-lettered after a few seconds in the backlog; a replay succeeds.
    DeadLetter,
    /// `reserve_stock` fails permanently and the refund fails until an
    /// operator retries the saga: it ends `stuck`, then `compensated`.
    StuckSaga,
}

impl DemoFault {
    /// The header naming the fault.
    pub const HEADER: &'static str = "x-keel-demo-fault";

    /// Parses the header value.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim() {
            "dead-letter" => Some(Self::DeadLetter),
            "stuck-saga" => Some(Self::StuckSaga),
            _ => None,
        }
    }
}

/// Fields a reader does not know, kept so that re-emitting an event loses
/// nothing a newer producer added (the tolerant reader).
pub type UnknownFields = Map<String, Value>;

/// Reads an integer written as JSON allows and JSON Schema counts as one:
/// `2`, `2.0` or `2e0`, but never `2.5`. The OpenAPI document says
/// `integer`, so the server takes every integer the document allows.
fn whole_number<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64>,
{
    use serde::de::Error;
    /// Integers beyond this are not exact as floats (2^53).
    const EXACT: f64 = 9_007_199_254_740_992.0;
    let number = serde_json::Number::deserialize(deserializer)?;
    let whole = match (number.as_i64(), number.as_f64()) {
        (Some(n), _) => Some(n),
        (None, Some(f)) if f.fract() == 0.0 && f.abs() <= EXACT => Some(f as i64),
        _ => None,
    };
    whole
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| D::Error::custom(format!("{number} is not an integer in range")))
}

/// One line of an order.
///
/// Read tolerantly: inside an event, a field added by a newer producer is
/// kept in [`extra`](Self::extra) and written back out unchanged. A
/// client's `POST /orders` is still held to the documented fields, by
/// [`NewOrder::validate`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Item {
    /// The stock keeping unit: 1 to 64 characters of `[A-Za-z0-9_-]`.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", min_length = 1, max_length = 64)]
    pub sku: String,
    /// How many units (1 to 1000).
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(deserialize_with = "whole_number")]
    pub qty: u32,
    /// The price of one unit in cents (integer minor units, never floats):
    /// 1 to 100,000,000.
    #[schema(minimum = 1, maximum = 100_000_000)]
    #[serde(deserialize_with = "whole_number")]
    pub unit_price_cents: i64,
    /// Fields this version does not know.
    #[serde(flatten, default, skip_serializing_if = "Map::is_empty")]
    #[schema(ignore)]
    pub extra: UnknownFields,
}

impl Item {
    /// A line of `qty` units of `sku` at `unit_price_cents` each.
    pub fn new(sku: impl Into<String>, qty: u32, unit_price_cents: i64) -> Self {
        Self {
            sku: sku.into(),
            qty,
            unit_price_cents,
            extra: UnknownFields::new(),
        }
    }
}

/// An order as a client submits it (`POST /orders`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewOrder {
    /// Who orders: 1 to 64 characters of `[A-Za-z0-9_-]`.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$", min_length = 1, max_length = 64)]
    pub customer_id: String,
    /// A three-letter ISO 4217 code, upper case (`USD`).
    #[schema(pattern = "^[A-Z]{3}$", min_length = 3, max_length = 3)]
    pub currency: String,
    /// 1 to 50 items.
    #[schema(min_items = 1, max_items = 50)]
    pub items: Vec<Item>,
}

/// Why an order was refused; each message says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidOrder {
    /// A customer id or sku is empty, too long or has odd characters.
    #[error("{field} must be 1 to {MAX_ID_LEN} characters of A-Z, a-z, 0-9, '_' or '-'")]
    BadId {
        /// The field.
        field: String,
    },
    /// The currency is not three upper-case letters.
    #[error("currency must be a three-letter upper-case ISO 4217 code such as USD")]
    BadCurrency,
    /// No items, or too many.
    #[error("an order needs 1 to {MAX_ITEMS} items")]
    ItemCount,
    /// A quantity is out of range.
    #[error("items[{index}].qty must be 1 to {MAX_QTY}")]
    Quantity {
        /// The item.
        index: usize,
    },
    /// A price is out of range.
    #[error("items[{index}].unitPriceCents must be 1 to {MAX_UNIT_PRICE_CENTS}")]
    Price {
        /// The item.
        index: usize,
    },
    /// An item has a field the API does not define.
    #[error("items[{index}] has an unknown field {field:?}: use sku, qty and unitPriceCents")]
    UnknownField {
        /// The item.
        index: usize,
        /// The first unknown field.
        field: String,
    },
}

/// Whether `s` is a customer id or sku: 1 to [`MAX_ID_LEN`] characters of
/// `[A-Za-z0-9_-]` (the OpenAPI document's `^[A-Za-z0-9_-]{1,64}$`).
pub fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl NewOrder {
    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), InvalidOrder> {
        if !valid_id(&self.customer_id) {
            return Err(InvalidOrder::BadId {
                field: "customerId".into(),
            });
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(InvalidOrder::BadCurrency);
        }
        if self.items.is_empty() || self.items.len() > MAX_ITEMS {
            return Err(InvalidOrder::ItemCount);
        }
        for (index, item) in self.items.iter().enumerate() {
            if !valid_id(&item.sku) {
                return Err(InvalidOrder::BadId {
                    field: format!("items[{index}].sku"),
                });
            }
            if item.qty == 0 || item.qty > MAX_QTY {
                return Err(InvalidOrder::Quantity { index });
            }
            if item.unit_price_cents <= 0 || item.unit_price_cents > MAX_UNIT_PRICE_CENTS {
                return Err(InvalidOrder::Price { index });
            }
            if let Some(field) = item.extra.keys().next() {
                return Err(InvalidOrder::UnknownField {
                    index,
                    field: field.clone(),
                });
            }
        }
        Ok(())
    }

    /// The total in cents. Bounded by the validation limits, so it cannot
    /// overflow (50 × 1000 × 10⁸ < 2⁶³).
    pub fn total_cents(&self) -> i64 {
        self.items
            .iter()
            .map(|i| i64::from(i.qty) * i.unit_price_cents)
            .sum()
    }
}

/// Where an order is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// Accepted; fulfilment is under way.
    Pending,
    /// Paid, reserved, shipped and receipted.
    Completed,
    /// Fulfilment failed and everything done was undone (refunded, released).
    Compensated,
    /// Needs an operator: see the saga.
    Stuck,
    /// Cancelled by an operator.
    Cancelled,
}

impl OrderStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Completed => "completed",
            Self::Compensated => "compensated",
            Self::Stuck => "stuck",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "completed" => Self::Completed,
            "compensated" => Self::Compensated,
            "stuck" => Self::Stuck,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }
}

/// A customer, as their orders describe them (the shop keeps no customer
/// table of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Customer {
    /// The customer's id.
    pub id: String,
    /// How many orders they placed.
    pub order_count: i64,
    /// The sum of their orders' totals, in cents.
    pub total_spent_cents: i64,
}

/// A product: a stock row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Product {
    /// Its SKU.
    pub sku: String,
    /// Units in stock.
    pub available: i64,
}

/// An accepted order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Order {
    /// The order id (UUIDv7: sorts by creation time).
    pub id: String,
    /// Who ordered.
    pub customer_id: String,
    /// The currency of every amount.
    pub currency: String,
    /// The items.
    pub items: Vec<Item>,
    /// The sum of `qty × unitPriceCents`.
    pub total_cents: i64,
    /// Where fulfilment is.
    pub status: OrderStatus,
    /// When it was accepted (RFC 3339).
    pub created_at: String,
    /// Shipping's delivery estimate: on `GET /orders/{id}` only, and
    /// absent when shipping cannot answer and has not answered recently.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery_estimate: Option<DeliveryEstimate>,
}

/// How long delivery takes, by the shipping service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryEstimate {
    /// Days until delivery.
    pub days: u32,
    /// Present when shipping could not answer just now: this is its last
    /// answer, this many seconds old (never more than 10 minutes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_seconds: Option<u64>,
}

/// One carrier's quote for shipping an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShippingQuote {
    /// The carrier.
    pub carrier: String,
    /// What it charges, in cents.
    pub price_cents: i64,
    /// Days until delivery.
    pub days: u32,
}

/// A carrier that did not quote in time, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MissingCarrier {
    /// The carrier.
    pub carrier: String,
    /// `too_slow` (it did not answer within the budget), `circuit_open`
    /// (it kept failing or being too slow, so it was not asked),
    /// `failed`, or `deadline_exceeded` (too little time was left to ask).
    pub reason: String,
}

/// `GET /orders/{id}/shipping-quotes`: the quotes that arrived in time.
/// `partial` says the list is incomplete; `missing` says whose quote is
/// not in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShippingQuotes {
    /// The quotes, in the carriers' order.
    pub quotes: Vec<ShippingQuote>,
    /// Whether any carrier is missing.
    pub partial: bool,
    /// The carriers missing, and why.
    pub missing: Vec<MissingCarrier>,
}

/// `shop.order.placed.v1`: an order was accepted. Its subject (and so the
/// partition key) is the order id.
///
/// A tolerant reader: fields a newer producer adds, at the top or in an
/// item, are kept in `extra` and re-emitted unchanged, so a v2 producer
/// never dead-letters a v1 consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderPlaced {
    /// The order id.
    pub order_id: String,
    /// Who ordered.
    pub customer_id: String,
    /// The currency.
    pub currency: String,
    /// The items.
    pub items: Vec<Item>,
    /// The total in cents.
    pub total_cents: i64,
    /// A demo fault to act out (only with `--demo-faults`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demo_fault: Option<DemoFault>,
    /// Fields this version does not know.
    #[serde(flatten, default, skip_serializing_if = "Map::is_empty")]
    pub extra: UnknownFields,
}

impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";

    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order() -> NewOrder {
        NewOrder {
            customer_id: "c-1".into(),
            currency: "USD".into(),
            items: vec![Item::new("tea", 2, 450)],
        }
    }

    #[test]
    fn a_good_order_totals_its_items() {
        assert_eq!(order().validate(), Ok(()));
        assert_eq!(order().total_cents(), 900);
    }

    #[test]
    fn bad_orders_say_what_is_wrong() {
        let mut o = order();
        o.customer_id = "bad id".into();
        assert!(matches!(o.validate(), Err(InvalidOrder::BadId { .. })));
        let mut o = order();
        o.currency = "usd".into();
        assert_eq!(o.validate(), Err(InvalidOrder::BadCurrency));
        let mut o = order();
        o.items.clear();
        assert_eq!(o.validate(), Err(InvalidOrder::ItemCount));
        let mut o = order();
        o.items[0].qty = 0;
        assert_eq!(o.validate(), Err(InvalidOrder::Quantity { index: 0 }));
        let mut o = order();
        o.items[0].unit_price_cents = -1;
        assert_eq!(o.validate(), Err(InvalidOrder::Price { index: 0 }));
        let mut o = order();
        o.items = vec![o.items[0].clone(); MAX_ITEMS + 1];
        assert_eq!(o.validate(), Err(InvalidOrder::ItemCount));
    }

    /// JSON Schema counts `2.0` as an integer, so the document's `integer`
    /// admits it; the reader takes it, and still refuses `2.5`.
    #[test]
    fn integers_are_read_as_json_schema_counts_them() {
        let item: Item = serde_json::from_str(r#"{"sku":"tea","qty":2.0,"unitPriceCents":45e1}"#)
            .expect("reads");
        assert_eq!((item.qty, item.unit_price_cents), (2, 450));
        for bad in [r#"2.5"#, r#"-1"#, r#"1e30"#, r#""2""#] {
            let json = format!(r#"{{"sku":"tea","qty":{bad},"unitPriceCents":1}}"#);
            assert!(serde_json::from_str::<Item>(&json).is_err(), "qty {bad}");
        }
    }

    #[test]
    fn a_client_order_is_held_to_the_documented_fields() {
        let body = r#"{"customerId":"c-1","currency":"USD",
            "items":[{"sku":"tea","qty":1,"unitPriceCents":450,"discount":100}]}"#;
        let order: NewOrder = serde_json::from_str(body).expect("parses");
        assert_eq!(
            order.validate(),
            Err(InvalidOrder::UnknownField {
                index: 0,
                field: "discount".into()
            })
        );
        let body = r#"{"customerId":"c-1","currency":"USD","items":[],"coupon":"X"}"#;
        assert!(serde_json::from_str::<NewOrder>(body).is_err());
    }

    /// The tolerant reader: a v2 producer's extra fields, at the top and
    /// in an item, survive a read and a re-emit unchanged.
    #[test]
    fn an_order_event_from_a_newer_producer_round_trips_losslessly() {
        let v2 = serde_json::json!({
            "orderId": "o-1",
            "customerId": "c-1",
            "currency": "USD",
            "items": [{"sku": "tea", "qty": 2, "unitPriceCents": 450, "engraving": "hi"}],
            "totalCents": 900,
            "giftWrap": {"paper": "blue"},
            "occurredAt": "2026-12-01T00:00:00.000Z",
        });
        let placed: OrderPlaced = serde_json::from_value(v2.clone()).expect("a v1 reader reads v2");
        assert_eq!(placed.items[0].qty, 2);
        assert_eq!(
            placed.extra["giftWrap"],
            serde_json::json!({"paper": "blue"})
        );
        assert_eq!(serde_json::to_value(&placed).expect("re-emit"), v2);
    }
}
