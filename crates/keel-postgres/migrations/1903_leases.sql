-- Leases (issue 20): per name, who holds it, its fencing token and its end.
-- A released lease keeps its row, so tokens never start over.
CREATE TABLE keel_leases (
    name       TEXT        NOT NULL PRIMARY KEY,
    holder     TEXT        NOT NULL,
    token      BIGINT      NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
