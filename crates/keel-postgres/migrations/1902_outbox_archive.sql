-- Outbox archiving (issue 20): published rows moved here instead of being
-- deleted, for audits past the outbox's retention. Nothing reads it on the
-- hot path; its own retention is the operator's.
CREATE TABLE keel_outbox_archive (
    id            BIGINT      PRIMARY KEY,       -- the outbox id, never reused
    event_id      TEXT        NOT NULL,
    topic         TEXT        NOT NULL,
    partition_key TEXT        NOT NULL,
    headers       JSONB       NOT NULL,
    payload       BYTEA       NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL,
    published_at  TIMESTAMPTZ NOT NULL,
    archived_at   TIMESTAMPTZ NOT NULL
);
