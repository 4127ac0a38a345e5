-- The trace a webhook delivery was queued in (W3C traceparent): each
-- attempt's span is its child, so the delivery joins the story of the
-- event that caused it.
ALTER TABLE keel_webhook_deliveries ADD COLUMN traceparent TEXT;
