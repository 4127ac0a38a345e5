-- The version guard: the newest version of each entity a scope applied.
CREATE TABLE keel_entity_versions (
    scope   TEXT   NOT NULL,
    entity  TEXT   NOT NULL,
    version BIGINT NOT NULL,
    PRIMARY KEY (scope, entity)
);
