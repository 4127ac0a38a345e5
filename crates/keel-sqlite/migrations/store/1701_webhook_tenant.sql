-- The tenant that owns an endpoint: callers see and change only their own.
ALTER TABLE keel_webhook_endpoints ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
CREATE INDEX keel_webhook_endpoints_tenant ON keel_webhook_endpoints (tenant);
