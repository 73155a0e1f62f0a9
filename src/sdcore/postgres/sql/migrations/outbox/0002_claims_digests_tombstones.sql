-- Outbox: outcomes fenced by a claim token, key reuse detected by a message digest,
-- and pruned keys kept as tombstones for the deduplication window. Rows written by 0.1.0 keep
-- their job_id ("sd-" + sha256(key)): the relay publishes the stored id, never a recomputed one.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS claim_token uuid;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS message_digest bytea;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS pruned_at timestamptz;
-- The digest is the SHA-256 of jsonb's canonical text of [queue, name, payload, options]: equal
-- messages (as jsonb compares them, key order ignored) have equal digests.
UPDATE {table}
SET message_digest = sha256(convert_to(jsonb_build_array(queue, name, payload, options)::text, 'UTF8'))
WHERE message_digest IS NULL;
ALTER TABLE {table} ALTER COLUMN message_digest SET NOT NULL;
-- Pruning turns old published rows into tombstones (payload dropped, key and digest kept), then
-- deletes tombstones past the window: one index for each step, so neither scans the other's rows.
DROP INDEX IF EXISTS {object:published_idx};
CREATE INDEX IF NOT EXISTS {name:live_published_idx} ON {table} (published_at)
    WHERE status = 'PUBLISHED' AND pruned_at IS NULL;
CREATE INDEX IF NOT EXISTS {name:pruned_idx} ON {table} (published_at) WHERE pruned_at IS NOT NULL;
