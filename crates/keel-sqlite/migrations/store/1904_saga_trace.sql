-- The trace a saga was started in (W3C traceparent), so that its step
-- spans, run later by the orchestrator, join the story of the request or
-- message that started it.
ALTER TABLE keel_sagas ADD COLUMN traceparent TEXT;
