-- Idempotency keys (the HTTP Idempotency-Key layer): one row per key and
-- principal, recorded BEFORE the request is processed so that concurrent
-- duplicates execute once, then completed with the response to replay.
-- Timestamps are Unix milliseconds (UTC).
CREATE TABLE keel_idempotency (
    principal    TEXT    NOT NULL,           -- keys are scoped per caller
    idem_key     TEXT    NOT NULL,           -- the client's key, <= 255 chars
    fingerprint  TEXT    NOT NULL,           -- hash of the request it stands for
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    locked_until INTEGER,                    -- in flight: presumed dead after this
    status       INTEGER,                    -- completed: the stored response
    headers      TEXT,                       -- JSON array of [name, value]
    body         BLOB,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,           -- the key's TTL, inclusive
    PRIMARY KEY (principal, idem_key)
);

-- The prune job finds expired keys without a table scan.
CREATE INDEX keel_idempotency_expires ON keel_idempotency (expires_at);
