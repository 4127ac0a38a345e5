-- Per-stream (per-user) resumable event logs behind long polling, SSE and
-- WebSocket. Timestamps are Unix milliseconds (UTC).

-- One counter per stream. The append bumps it in the caller's transaction,
-- so seqs are contiguous (1, 2, 3, ...), in commit order, and never reused:
-- the counter outlives the events that trimming deletes. One small row per
-- stream that ever had an event.
CREATE TABLE keel_event_log_streams (
    stream   TEXT    PRIMARY KEY,
    last_seq INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE keel_event_log (
    -- A rowid table: payloads can be kilobytes, which WITHOUT ROWID tables
    -- store badly. The id is only for batched deletes.
    id         INTEGER PRIMARY KEY,
    stream     TEXT    NOT NULL,
    seq        INTEGER NOT NULL,
    event_type TEXT    NOT NULL,
    data       TEXT    NOT NULL,             -- JSON
    at         INTEGER NOT NULL
);

-- Resumption reads "stream S after seq N" in seq order; count retention
-- finds a stream's oldest events.
CREATE UNIQUE INDEX keel_event_log_stream_seq ON keel_event_log (stream, seq);

-- Age retention deletes the oldest events without a table scan.
CREATE INDEX keel_event_log_at ON keel_event_log (at);
