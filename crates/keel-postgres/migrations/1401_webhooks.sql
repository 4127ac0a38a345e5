-- Webhook endpoints, their queued deliveries and the delivery log.
CREATE TABLE keel_webhook_endpoints (
    id              TEXT        PRIMARY KEY,
    url             TEXT        NOT NULL,
    description     TEXT        NOT NULL DEFAULT '',
    event_types     JSONB       NOT NULL DEFAULT '[]', -- empty = every type
    secrets         JSONB       NOT NULL DEFAULT '[]', -- oldest first, at most 2
    enabled         BOOLEAN     NOT NULL DEFAULT TRUE,
    disabled_reason TEXT,
    disabled_at     TIMESTAMPTZ,
    failing_since   TIMESTAMPTZ,
    last_success_at TIMESTAMPTZ,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL
);

CREATE TABLE keel_webhook_deliveries (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint_id     TEXT        NOT NULL REFERENCES keel_webhook_endpoints (id),
    event_id        TEXT        NOT NULL,
    event_type      TEXT        NOT NULL,
    payload         BYTEA       NOT NULL,
    status          TEXT        NOT NULL
        CHECK (status IN ('pending', 'succeeded', 'failed', 'disabled')),
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL,
    leased_by       TEXT,
    leased_until    TIMESTAMPTZ,
    UNIQUE (endpoint_id, event_id)
);

-- The claim walks each endpoint's due deliveries in due order (pending only).
CREATE INDEX keel_webhook_deliveries_due
    ON keel_webhook_deliveries (endpoint_id, next_attempt_at, id) WHERE status = 'pending';

-- Per-endpoint concurrency: leases are cleared on completion, so this is tiny.
CREATE INDEX keel_webhook_deliveries_leased
    ON keel_webhook_deliveries (endpoint_id) WHERE leased_until IS NOT NULL;

CREATE INDEX keel_webhook_deliveries_created
    ON keel_webhook_deliveries (endpoint_id, created_at);

CREATE INDEX keel_webhook_deliveries_finished
    ON keel_webhook_deliveries (updated_at) WHERE status <> 'pending';

CREATE TABLE keel_webhook_attempts (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id     BIGINT      NOT NULL REFERENCES keel_webhook_deliveries (id),
    attempt         INTEGER     NOT NULL,
    at              TIMESTAMPTZ NOT NULL,
    url             TEXT        NOT NULL,
    request_headers JSONB       NOT NULL,        -- array of [name, value]
    response_status INTEGER,
    response_body   TEXT,
    latency_us      BIGINT      NOT NULL,
    error           TEXT
);

CREATE INDEX keel_webhook_attempts_delivery ON keel_webhook_attempts (delivery_id, id);
