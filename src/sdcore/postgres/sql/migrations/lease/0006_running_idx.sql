-- The RUNNING rows, for operators: `sdcore jobs list --status RUNNING`, LeaseAdmin.list_runs and
-- the dashboard's leases page. Since 0004 no other index holds status, so listing what runs
-- would read the whole table (a million finished rows, against a few RUNNING ones). This
-- partial index holds only RUNNING rows (a handful, whatever the table's size) in the listing's
-- order.
--
-- The price: status is now in an index predicate, so complete and fail (RUNNING -> SUCCESS/FAIL)
-- are no longer HOT updates (they write an entry into each index, once per run); heartbeats,
-- which change only modified_at, still are. Idempotent; on a large table the CREATE INDEX scans
-- it once (build it beforehand with CREATE INDEX CONCURRENTLY under the same name if that
-- matters, and this migration keeps it).
CREATE INDEX IF NOT EXISTS {name:running_idx} ON {table} (created_at DESC, id DESC)
    WHERE status = 'RUNNING';
