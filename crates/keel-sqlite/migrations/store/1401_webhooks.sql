-- Webhook endpoints, their queued deliveries and the delivery log.
-- Timestamps are Unix milliseconds (UTC).
CREATE TABLE keel_webhook_endpoints (
    id              TEXT    PRIMARY KEY,
    url             TEXT    NOT NULL,
    description     TEXT    NOT NULL DEFAULT '',
    event_types     TEXT    NOT NULL DEFAULT '[]', -- JSON array; empty = every type
    secrets         TEXT    NOT NULL DEFAULT '[]', -- JSON array, oldest first, at most 2
    enabled         INTEGER NOT NULL DEFAULT 1 CHECK (enabled IN (0, 1)),
    disabled_reason TEXT,
    disabled_at     INTEGER,
    failing_since   INTEGER,                       -- first failure after the last success
    last_success_at INTEGER,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE keel_webhook_deliveries (
    -- AUTOINCREMENT: ids are never reused, so an operator's "resend 4711"
    -- can never hit another delivery after pruning.
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    endpoint_id     TEXT    NOT NULL REFERENCES keel_webhook_endpoints (id),
    event_id        TEXT    NOT NULL,             -- the webhook-id receivers dedupe on
    event_type      TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    status          TEXT    NOT NULL
        CHECK (status IN ('pending', 'succeeded', 'failed', 'disabled')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    leased_by       TEXT,
    leased_until    INTEGER,                      -- NULL unless being attempted
    -- A redelivered event queues nothing twice.
    UNIQUE (endpoint_id, event_id)
);

-- The claim walks each endpoint's due deliveries in due order. Partial: it
-- holds only pending rows, however many finished ones pile up.
CREATE INDEX keel_webhook_deliveries_due
    ON keel_webhook_deliveries (endpoint_id, next_attempt_at, id) WHERE status = 'pending';

-- "How many deliveries of this endpoint are in flight?" (per-endpoint
-- concurrency). Leases are cleared on completion, so this stays tiny.
CREATE INDEX keel_webhook_deliveries_leased
    ON keel_webhook_deliveries (endpoint_id) WHERE leased_until IS NOT NULL;

-- The per-endpoint delivery list and replay of a time range.
CREATE INDEX keel_webhook_deliveries_created
    ON keel_webhook_deliveries (endpoint_id, created_at);

-- Pruning finds the oldest finished deliveries without a table scan.
CREATE INDEX keel_webhook_deliveries_finished
    ON keel_webhook_deliveries (updated_at) WHERE status <> 'pending';

CREATE TABLE keel_webhook_attempts (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    delivery_id     INTEGER NOT NULL REFERENCES keel_webhook_deliveries (id),
    attempt         INTEGER NOT NULL,
    at              INTEGER NOT NULL,
    url             TEXT    NOT NULL,
    request_headers TEXT    NOT NULL,             -- JSON array of [name, value]
    response_status INTEGER,
    response_body   TEXT,                         -- truncated by the sender
    latency_us      INTEGER NOT NULL,
    error           TEXT
);

CREATE INDEX keel_webhook_attempts_delivery ON keel_webhook_attempts (delivery_id, id);
