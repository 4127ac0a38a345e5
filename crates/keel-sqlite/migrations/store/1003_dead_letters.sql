-- Messages a consumer gave up on, with their whole error history.
CREATE TABLE keel_dead_letters (
    seq            INTEGER PRIMARY KEY,      -- insertion order, a tie-break
    id             TEXT    NOT NULL UNIQUE,
    message_id     TEXT    NOT NULL,
    topic          TEXT    NOT NULL,
    partition_key  TEXT    NOT NULL,
    headers        TEXT    NOT NULL,         -- JSON object of strings
    payload        BLOB    NOT NULL,
    consumer_group TEXT    NOT NULL,
    error_kind     TEXT    NOT NULL,
    attempts       TEXT    NOT NULL,         -- JSON array, oldest first
    dead_at        INTEGER NOT NULL,         -- Unix ms
    status         TEXT    NOT NULL
        CHECK (status IN ('pending', 'replayed', 'discarded')),
    settled_at     INTEGER
);

-- The operator console: pending letters by error kind, counts by kind.
CREATE INDEX keel_dead_letters_status_kind
    ON keel_dead_letters (status, error_kind, dead_at);
-- Listing oldest first, optionally by topic.
CREATE INDEX keel_dead_letters_topic ON keel_dead_letters (topic, dead_at);
CREATE INDEX keel_dead_letters_dead_at ON keel_dead_letters (dead_at);

-- Failed attempts of messages still being retried, so the history travels
-- with a message that is dead-lettered later.
CREATE TABLE keel_failures (
    seq            INTEGER PRIMARY KEY,
    consumer_group TEXT    NOT NULL,
    message_id     TEXT    NOT NULL,
    attempt        INTEGER NOT NULL,
    error          TEXT    NOT NULL,
    at             INTEGER NOT NULL          -- Unix ms
);

CREATE INDEX keel_failures_message
    ON keel_failures (consumer_group, message_id, at);
