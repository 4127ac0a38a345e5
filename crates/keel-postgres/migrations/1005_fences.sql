-- Fencing tokens: the last token handed out per resource. Tokens only grow.
CREATE TABLE keel_fences (
    resource   TEXT   PRIMARY KEY,
    last_token BIGINT NOT NULL
);
