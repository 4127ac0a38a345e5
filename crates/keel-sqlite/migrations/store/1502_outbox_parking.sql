-- Parking (issue 11): a row the broker refuses for good is parked instead
-- of being reclaimed forever, and only its own key waits behind it.
ALTER TABLE keel_outbox ADD COLUMN attempts   INTEGER NOT NULL DEFAULT 0; -- failed publishes
ALTER TABLE keel_outbox ADD COLUMN last_error TEXT;                       -- the latest failure
ALTER TABLE keel_outbox ADD COLUMN parked_at  INTEGER;                    -- NULL = not parked

-- The operator's list of parked rows, without a scan. Partial: it holds
-- only the (few) parked rows.
CREATE INDEX keel_outbox_parked
    ON keel_outbox (id) WHERE parked_at IS NOT NULL;
