-- Schedules: a trigger or backfill carries the request id its client chose (the CLI
-- draws one per invocation, the dashboard one per rendered form). A retry after a lost COMMIT
-- reply, or a double submit, finds the action its first request recorded instead of recording
-- a second run: one action per (schedule, request id). NULL for actions recorded without one
-- (and by older versions), which never collide.
ALTER TABLE {object:actions} ADD COLUMN IF NOT EXISTS request_id text;
CREATE UNIQUE INDEX IF NOT EXISTS {name:actions_request_idx} ON {object:actions}
    (schedule, request_id) WHERE request_id IS NOT NULL;
