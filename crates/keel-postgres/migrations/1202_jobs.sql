-- Asynchronous jobs (202 Accepted, then poll /jobs/{id}).
CREATE TABLE keel_jobs (
    id              TEXT        PRIMARY KEY,
    kind            TEXT        NOT NULL,
    idempotency_key TEXT        NOT NULL,
    params          JSONB       NOT NULL,
    status          TEXT        NOT NULL
        CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    progress        SMALLINT    NOT NULL DEFAULT 0 CHECK (progress BETWEEN 0 AND 100),
    result_location TEXT,
    error           TEXT,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL,
    expires_at      TIMESTAMPTZ NOT NULL,
    -- A retried POST returns the SAME job.
    UNIQUE (kind, idempotency_key)
);

CREATE INDEX keel_jobs_expires ON keel_jobs (expires_at);
