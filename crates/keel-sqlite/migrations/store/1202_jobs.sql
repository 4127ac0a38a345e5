-- Asynchronous jobs (202 Accepted, then poll /jobs/{id}). Timestamps are
-- Unix milliseconds (UTC).
CREATE TABLE keel_jobs (
    id              TEXT    PRIMARY KEY,
    kind            TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    params          TEXT    NOT NULL,        -- JSON
    status          TEXT    NOT NULL
        CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    progress        INTEGER NOT NULL DEFAULT 0 CHECK (progress BETWEEN 0 AND 100),
    result_location TEXT,
    error           TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    expires_at      INTEGER NOT NULL,
    -- A retried POST returns the SAME job: this constraint settles two
    -- concurrent retries with the same key.
    UNIQUE (kind, idempotency_key)
) WITHOUT ROWID;

-- The prune job finds expired jobs without a table scan.
CREATE INDEX keel_jobs_expires ON keel_jobs (expires_at);
