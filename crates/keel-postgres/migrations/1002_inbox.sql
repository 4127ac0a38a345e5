-- The idempotent consumer's record of processed events, one row per
-- (event, handler), written in the same transaction as the handler's effect.
CREATE TABLE keel_inbox (
    event_id     TEXT        NOT NULL,
    handler      TEXT        NOT NULL,
    processed_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (event_id, handler)
);

-- Pruning rows older than the redelivery window.
CREATE INDEX keel_inbox_processed_at ON keel_inbox (processed_at);
