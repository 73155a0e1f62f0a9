-- The run history's RUNNING rows by tick. When an acquire takes a tick over (a new fencing token),
-- run_started closes that tick's earlier attempts still shown RUNNING (their replica died or lost
-- the lease) as abandoned; this partial index holds only RUNNING rows (a handful, whatever the
-- history's size), so that lookup never reads a schedule's whole history. Idempotent.
CREATE INDEX IF NOT EXISTS {name:runs_running_idx} ON {object:runs} (schedule, run_key)
    WHERE status = 'RUNNING';
