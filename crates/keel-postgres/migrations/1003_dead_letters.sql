-- Messages a consumer gave up on, with their whole error history.
CREATE TABLE keel_dead_letters (
    seq            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, -- a tie-break
    id             TEXT        NOT NULL UNIQUE,
    message_id     TEXT        NOT NULL,
    topic          TEXT        NOT NULL,
    partition_key  TEXT        NOT NULL,
    headers        JSONB       NOT NULL,
    payload        BYTEA       NOT NULL,
    consumer_group TEXT        NOT NULL,
    error_kind     TEXT        NOT NULL,
    attempts       JSONB       NOT NULL,         -- array, oldest first
    dead_at        TIMESTAMPTZ NOT NULL,
    status         TEXT        NOT NULL
        CHECK (status IN ('pending', 'replayed', 'discarded')),
    settled_at     TIMESTAMPTZ
);

CREATE INDEX keel_dead_letters_status_kind
    ON keel_dead_letters (status, error_kind, dead_at);
CREATE INDEX keel_dead_letters_topic ON keel_dead_letters (topic, dead_at);
CREATE INDEX keel_dead_letters_dead_at ON keel_dead_letters (dead_at);

-- Failed attempts of messages still being retried, so the history travels
-- with a message that is dead-lettered later.
CREATE TABLE keel_failures (
    seq            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_group TEXT        NOT NULL,
    message_id     TEXT        NOT NULL,
    attempt        INTEGER     NOT NULL,
    error          TEXT        NOT NULL,
    at             TIMESTAMPTZ NOT NULL
);

CREATE INDEX keel_failures_message
    ON keel_failures (consumer_group, message_id, at);
