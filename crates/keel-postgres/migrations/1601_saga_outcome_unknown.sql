-- An unknown outcome is never forgotten: whether an attempt at the current
-- step's action may have taken effect (it timed out, lost its reply, or the
-- orchestrator stopped during it), and when the first attempt at the
-- current call was made (forward recovery's time budget counts from it).
ALTER TABLE keel_sagas ADD COLUMN outcome_unknown BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE keel_sagas ADD COLUMN first_attempt_at TIMESTAMPTZ;
