-- Groups that expire when idle (SubscribeOptions::expire_after_idle), such as
-- request-reply's per-process reply topics. `expire_after_ms` is NULL for a
-- group that never expires; `last_seen_at` (Unix ms) is when a member last
-- read from it.
ALTER TABLE keel_broker_groups ADD COLUMN expire_after_ms INTEGER;
ALTER TABLE keel_broker_groups ADD COLUMN last_seen_at INTEGER;

-- A topic created by such a subscription is `expiring`: it is deleted,
-- messages and all, once its last group is. Topic ids become AUTOINCREMENT so
-- a deleted topic's id is never given to a new topic: a process that still
-- has the old id cached must not publish into someone else's topic.
CREATE TABLE keel_broker_topics_v2 (
    topic_id INTEGER PRIMARY KEY AUTOINCREMENT,
    name     TEXT    NOT NULL UNIQUE,
    expiring INTEGER NOT NULL DEFAULT 0
);
INSERT INTO keel_broker_topics_v2 (topic_id, name) SELECT topic_id, name FROM keel_broker_topics;
DROP TABLE keel_broker_topics;
ALTER TABLE keel_broker_topics_v2 RENAME TO keel_broker_topics;
