-- Saga instances, saved after every step with an optimistic version.
CREATE TABLE keel_sagas (
    id              TEXT        PRIMARY KEY,
    kind            TEXT        NOT NULL,
    status          TEXT        NOT NULL CHECK (status IN (
        'running', 'compensating', 'completed', 'compensated', 'stuck', 'cancelled')),
    step            BIGINT      NOT NULL,
    data            JSONB       NOT NULL,
    attempts        BIGINT      NOT NULL,
    last_error      TEXT,
    next_attempt_at TIMESTAMPTZ NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    updated_at      TIMESTAMPTZ NOT NULL,
    version         BIGINT      NOT NULL
);

-- The worker's "what is due" scan; only unfinished sagas.
CREATE INDEX keel_sagas_due
    ON keel_sagas (next_attempt_at)
    WHERE status IN ('running', 'compensating', 'stuck');

CREATE INDEX keel_sagas_status_updated ON keel_sagas (status, updated_at);
CREATE INDEX keel_sagas_updated ON keel_sagas (updated_at);
