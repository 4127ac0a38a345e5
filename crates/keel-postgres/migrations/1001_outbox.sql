-- The transactional outbox: events written in the business transaction,
-- published afterwards by relays that claim rows with a lease.
CREATE TABLE keel_outbox (
    -- An identity is never reused; ids are handed out at INSERT, not at
    -- COMMIT, so a lower id can commit after a higher one: the relay
    -- therefore keeps no high-water mark (see outbox.rs).
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id      TEXT        NOT NULL UNIQUE,   -- consumers dedupe on this
    topic         TEXT        NOT NULL,
    partition_key TEXT        NOT NULL,          -- preserves per-entity order
    headers       JSONB       NOT NULL DEFAULT '{}',
    payload       BYTEA       NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL,
    published_at  TIMESTAMPTZ,                   -- NULL = not yet published
    claimed_by    TEXT,                          -- the relay holding the lease
    claimed_until TIMESTAMPTZ                    -- the lease's end
);

-- The relay's scan, in id order. Partial: it holds only unpublished rows,
-- so it stays tiny however many published rows pile up before pruning.
CREATE INDEX keel_outbox_unpublished
    ON keel_outbox (id) WHERE published_at IS NULL;

-- "Is an earlier row of this key leased by another relay?" (per-key order
-- across relays). Partial for the same reason.
CREATE INDEX keel_outbox_unpublished_key
    ON keel_outbox (partition_key, id) WHERE published_at IS NULL;

-- The prune job finds the oldest published rows without a table scan.
CREATE INDEX keel_outbox_published
    ON keel_outbox (published_at) WHERE published_at IS NOT NULL;
