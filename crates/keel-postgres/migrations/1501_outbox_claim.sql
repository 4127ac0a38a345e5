-- A relay's claim in one statement, so one round trip instead of four
-- (BEGIN, the claim lock, the lease, COMMIT). It takes the schema's claim
-- lock, then leases rows in a statement of its own: a VOLATILE function's
-- statements each take a fresh snapshot, so the lease sees every claim
-- committed before the lock was granted (see outbox.rs for why claims are
-- serialized). The lock is transaction-scoped: the caller's statement is
-- its own transaction, so it is held for this call only.
CREATE FUNCTION keel_outbox_claim(
    lock_key TEXT, relay TEXT, lease_until TIMESTAMPTZ, at TIMESTAMPTZ, max_rows BIGINT)
RETURNS TABLE (id BIGINT, event_id TEXT, topic TEXT, partition_key TEXT, headers TEXT,
               payload BYTEA, created_at TIMESTAMPTZ)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext(lock_key));
    RETURN QUERY
    WITH candidates AS (
      SELECT o.id FROM keel_outbox o
       WHERE o.published_at IS NULL
         AND (o.claimed_until IS NULL OR o.claimed_until <= at OR o.claimed_by = relay)
         AND NOT EXISTS (
           SELECT 1 FROM keel_outbox e
            WHERE e.partition_key = o.partition_key
              AND e.published_at IS NULL
              AND e.id < o.id
              AND e.claimed_until > at
              AND e.claimed_by <> relay)
       ORDER BY o.id
       LIMIT max_rows
       FOR UPDATE SKIP LOCKED)
    UPDATE keel_outbox AS o SET claimed_by = relay, claimed_until = lease_until
      FROM candidates c
     WHERE o.id = c.id
    RETURNING o.id, o.event_id, o.topic, o.partition_key, o.headers::text, o.payload,
              o.created_at;
END
$$;
