-- Per-stream (per-user) resumable event logs behind long polling, SSE and
-- WebSocket.

-- One counter per stream, bumped in the caller's transaction: the row lock
-- it takes until COMMIT orders concurrent appends, so seqs are contiguous,
-- in commit order, and never reused (the counter outlives trimmed events).
CREATE TABLE keel_event_log_streams (
    stream   TEXT   PRIMARY KEY,
    last_seq BIGINT NOT NULL
);

CREATE TABLE keel_event_log (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream     TEXT        NOT NULL,
    seq        BIGINT      NOT NULL,
    event_type TEXT        NOT NULL,
    data       JSONB       NOT NULL,
    at         TIMESTAMPTZ NOT NULL,
    UNIQUE (stream, seq)
);

CREATE INDEX keel_event_log_at ON keel_event_log (at);
