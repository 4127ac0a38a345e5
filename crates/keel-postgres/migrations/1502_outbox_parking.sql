-- Parking (issue 11): a row the broker refuses for good is parked instead
-- of being reclaimed forever, and only its own key waits behind it.
ALTER TABLE keel_outbox
    ADD COLUMN attempts   INTEGER     NOT NULL DEFAULT 0,  -- failed publishes
    ADD COLUMN last_error TEXT,                            -- the latest failure
    ADD COLUMN parked_at  TIMESTAMPTZ;                     -- NULL = not parked

-- The operator's list of parked rows, without a scan. Partial: it holds
-- only the (few) parked rows.
CREATE INDEX keel_outbox_parked
    ON keel_outbox (id) WHERE parked_at IS NOT NULL;

-- The claim of migration 1501, now skipping parked rows and every later row
-- of a parked row's key, and returning each row's attempts. Its result type
-- changes, so it is dropped and created again (in this migration's
-- transaction: no claim ever sees it missing).
DROP FUNCTION keel_outbox_claim(TEXT, TEXT, TIMESTAMPTZ, TIMESTAMPTZ, BIGINT);

CREATE FUNCTION keel_outbox_claim(
    lock_key TEXT, relay TEXT, lease_until TIMESTAMPTZ, at TIMESTAMPTZ, max_rows BIGINT)
RETURNS TABLE (id BIGINT, event_id TEXT, topic TEXT, partition_key TEXT, headers TEXT,
               payload BYTEA, created_at TIMESTAMPTZ, attempts INTEGER)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(lock_key));
    RETURN QUERY
    WITH candidates AS (
      SELECT o.id FROM keel_outbox o
       WHERE o.published_at IS NULL
         AND o.parked_at IS NULL
         AND (o.claimed_until IS NULL OR o.claimed_until <= at OR o.claimed_by = relay)
         AND NOT EXISTS (
           SELECT 1 FROM keel_outbox e
            WHERE e.partition_key = o.partition_key
              AND e.published_at IS NULL
              AND e.id < o.id
              AND (e.parked_at IS NOT NULL
                   OR (e.claimed_until > at AND e.claimed_by <> relay)))
       ORDER BY o.id
       LIMIT max_rows
       FOR UPDATE SKIP LOCKED)
    UPDATE keel_outbox AS o SET claimed_by = relay, claimed_until = lease_until
      FROM candidates c
     WHERE o.id = c.id
    RETURNING o.id, o.event_id, o.topic, o.partition_key, o.headers::text, o.payload,
              o.created_at, o.attempts;
END
$$;
