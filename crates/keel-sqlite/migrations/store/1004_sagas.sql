-- Saga instances, saved after every step with an optimistic version.
CREATE TABLE keel_sagas (
    id              TEXT    PRIMARY KEY,
    kind            TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN (
        'running', 'compensating', 'completed', 'compensated', 'stuck', 'cancelled')),
    step            INTEGER NOT NULL,
    data            TEXT    NOT NULL,        -- JSON
    attempts        INTEGER NOT NULL,
    last_error      TEXT,
    next_attempt_at INTEGER NOT NULL,        -- Unix ms
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    version         INTEGER NOT NULL
);

-- The worker's "what is due" scan; only unfinished sagas, so it stays small
-- as finished ones pile up. The query repeats this exact WHERE term.
CREATE INDEX keel_sagas_due
    ON keel_sagas (next_attempt_at)
    WHERE status IN ('running', 'compensating', 'stuck');

-- The operator view: by status and age of the last update.
CREATE INDEX keel_sagas_status_updated ON keel_sagas (status, updated_at);
CREATE INDEX keel_sagas_updated ON keel_sagas (updated_at);
