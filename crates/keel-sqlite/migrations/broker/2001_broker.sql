-- Keel's embedded broker (keel_sqlite::broker). Numbered 2xxx so these
-- migrations never clash with the store's 1xxx ones in a shared database file.

-- Topic names, interned to small integers so the hot indexes stay narrow.
CREATE TABLE IF NOT EXISTS keel_broker_topics (
    topic_id INTEGER PRIMARY KEY,
    name     TEXT    NOT NULL UNIQUE
);

-- The log. `seq` is the delivery order: AUTOINCREMENT, because a sequence must
-- never be reused after the newest rows are pruned (a group whose cursor had
-- passed a reused number would silently skip the new message).
CREATE TABLE IF NOT EXISTS keel_broker_messages (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    topic_id     INTEGER NOT NULL,
    message_id   TEXT    NOT NULL,
    msg_key      TEXT    NOT NULL,
    headers      TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    published_at INTEGER NOT NULL -- Unix ms
);
-- Publisher dedupe: one message id per topic.
CREATE UNIQUE INDEX IF NOT EXISTS keel_broker_messages_dedupe
    ON keel_broker_messages (topic_id, message_id);
-- A group's pull reads a topic in sequence order.
CREATE INDEX IF NOT EXISTS keel_broker_messages_log
    ON keel_broker_messages (topic_id, seq);

-- Consumer groups. `pulled_seq` is the highest sequence copied into the
-- group's pending rows; everything at or below it that has no pending row was
-- acked or terminated by the group.
CREATE TABLE IF NOT EXISTS keel_broker_groups (
    group_id   INTEGER PRIMARY KEY,
    topic_id   INTEGER NOT NULL,
    name       TEXT    NOT NULL,
    pulled_seq INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL, -- Unix ms
    UNIQUE (topic_id, name)
);

-- A group's unsettled messages: ready (leased = 0) or leased (leased = 1).
-- Acked and terminated messages have no row, so this table is as small as
-- the group's backlog. `head` marks the earliest pending message of its key:
-- only heads are delivered, which is what keeps per-key order. A head is
-- visible when `visible_at` (Unix ms) has passed: never delivered (0), nacked
-- and past its delay, or leased and past its lease. `delivery_count` also
-- serves as the lease token: every new lease increments it.
CREATE TABLE IF NOT EXISTS keel_broker_pending (
    group_id       INTEGER NOT NULL,
    seq            INTEGER NOT NULL,
    msg_key        TEXT    NOT NULL,
    head           INTEGER NOT NULL,
    leased         INTEGER NOT NULL DEFAULT 0,
    visible_at     INTEGER NOT NULL DEFAULT 0,
    delivery_count INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (group_id, seq)
) WITHOUT ROWID;
-- Is an earlier message of this key pending? Which one is next?
CREATE INDEX IF NOT EXISTS keel_broker_pending_by_key
    ON keel_broker_pending (group_id, msg_key, seq);
-- The deliverable candidates, in sequence order: only heads, so blocked
-- messages behind a busy key cost nothing to skip. (`head` is repeated as a
-- column so the index covers the queries that use it.)
CREATE INDEX IF NOT EXISTS keel_broker_pending_heads
    ON keel_broker_pending (group_id, seq, visible_at, head) WHERE head = 1;

-- When a head leaves the pending set (acked, terminated), the next pending
-- message of its key becomes the head. In the database rather than in the
-- code, so the invariant holds for every writer and an ack is one statement.
CREATE TRIGGER IF NOT EXISTS keel_broker_pending_promote
AFTER DELETE ON keel_broker_pending WHEN old.head = 1
BEGIN
    UPDATE keel_broker_pending SET head = 1
    WHERE group_id = old.group_id
      AND seq = (SELECT min(seq) FROM keel_broker_pending
                 WHERE group_id = old.group_id AND msg_key = old.msg_key);
END;
