-- How an endpoint's deliveries go on the wire: 'standard-webhooks',
-- 'cloudevents-structured' or 'cloudevents-binary'.
ALTER TABLE keel_webhook_endpoints ADD COLUMN format TEXT NOT NULL DEFAULT 'standard-webhooks';
