-- The claim walks unpublished rows in id order and stops after a batch.
-- With statistics from before a burst (a drained backlog, thousands of rows
-- marked published at once) the planner read them through a bitmap scan
-- instead: every entry of the unpublished index, dead ones included
-- (22,724 for one live row, 2,548 heap pages, 3.3 ms), then a sort, on
-- every claim until autovacuum came round, and append -> effect p50 went
-- from 2 ms to 6-8 ms for a minute or more. An index scan in id order stops
-- at the first live rows and marks the dead entries it passes, so the next
-- claim skips them.
ALTER FUNCTION keel_outbox_claim(TEXT, TEXT, TIMESTAMPTZ, TIMESTAMPTZ, BIGINT)
    SET enable_bitmapscan = off;
