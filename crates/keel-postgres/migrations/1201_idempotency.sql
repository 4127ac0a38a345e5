-- Idempotency keys (the HTTP Idempotency-Key layer): one row per key and
-- principal, recorded BEFORE the request is processed so that concurrent
-- duplicates execute once, then completed with the response to replay.
CREATE TABLE keel_idempotency (
    principal    TEXT        NOT NULL,
    idem_key     TEXT        NOT NULL,
    fingerprint  TEXT        NOT NULL,
    state        TEXT        NOT NULL CHECK (state IN ('in_flight', 'completed')),
    locked_until TIMESTAMPTZ,                -- in flight: presumed dead after this
    status       INTEGER,                    -- completed: the stored response
    headers      JSONB,                      -- array of [name, value]
    body         BYTEA,
    created_at   TIMESTAMPTZ NOT NULL,
    expires_at   TIMESTAMPTZ NOT NULL,       -- the key's TTL, inclusive
    PRIMARY KEY (principal, idem_key)
);

CREATE INDEX keel_idempotency_expires ON keel_idempotency (expires_at);
