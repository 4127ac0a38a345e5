-- The transactional outbox: events written in the business transaction,
-- published afterwards by a relay. Timestamps are Unix milliseconds (UTC).
CREATE TABLE keel_outbox (
    -- AUTOINCREMENT: ids are never reused, even after the newest rows are
    -- pruned, so "id order" is "commit order" for the relay forever.
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT    NOT NULL UNIQUE,   -- consumers dedupe on this
    topic         TEXT    NOT NULL,
    partition_key TEXT    NOT NULL,          -- preserves per-entity order
    headers       TEXT    NOT NULL DEFAULT '{}', -- JSON object of strings
    payload       BLOB    NOT NULL,
    created_at    INTEGER NOT NULL,
    published_at  INTEGER,                   -- NULL = not yet published
    claimed_by    TEXT,                      -- the relay holding the lease
    claimed_until INTEGER                    -- the lease's end
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
