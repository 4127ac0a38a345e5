-- The attempt that holds an in-flight key: only it may renew, complete or
-- release the key, so a holder that lost its lock to a takeover cannot
-- overwrite its successor. Rows from before this migration have none.
ALTER TABLE keel_idempotency ADD COLUMN owner TEXT;
