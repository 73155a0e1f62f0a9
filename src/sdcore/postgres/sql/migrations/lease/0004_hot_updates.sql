-- HOT-friendly indexes. An UPDATE is a heap-only tuple (HOT) update, which
-- writes no index entry at all, only when it changes no indexed column and the new row version
-- fits on the same page. complete/fail set status and modified_at, a heartbeat sets modified_at:
-- with the (status, modified_at) index of 0001 every one of them wrote a new entry into all four
-- indexes. That index served only the prune, which now walks an index on created_at instead (a
-- column no statement ever changes; a row's modified_at is never before its created_at, so
-- "modified_at < cutoff" rows all lie in "created_at < cutoff"). fillfactor 90 leaves room on
-- each page for the new version of a row completed right after it was inserted.
--
-- Idempotent, and safe from N replicas at once (the migration runner serializes them). On a
-- large table the CREATE INDEX blocks writes to the table while it builds (a few seconds per
-- million rows); build it beforehand with CREATE INDEX CONCURRENTLY under the same name if that
-- matters, and this migration keeps it.
CREATE INDEX IF NOT EXISTS {name:created_at_idx} ON {table} (created_at);
DROP INDEX IF EXISTS {object:status_modified_at_idx};
ALTER TABLE {table} SET (fillfactor = 90);
