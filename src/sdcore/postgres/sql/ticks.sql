-- Scheduler tick statements on the lease table for many ticks at once (sdcore.scheduling's batch
-- start; see sdcore/job_scheduler/_attempts.py for the single-tick statements and their rules).
-- {table} is the quoted table, {sequence} its fencing sequence as a regclass literal; every value
-- is a parameter. Rows come back lean, as from lease.sql's acquire_many: (lock_key, id,
-- fencing_token, idempotency_key, created_at, modified_at, attempts).

-- name: acquire_attempt_many
-- acquire_attempt for many ticks in one statement: the ticks of a burst, due at one instant. Each
-- key follows the rules of ACQUIRE_ATTEMPT exactly (a new key is inserted RUNNING with
-- attempts = 1; a RUNNING row silent for longer than its owner's lease is taken, attempts + 1; a
-- FAIL row released by an operator is taken with a new budget, attempts = 1; a FAIL row given back
-- unstarted (column given_back) is taken with the same attempts; another FAIL row
-- only while attempts < max_attempts and once its backoff has passed by the database clock; a
-- SUCCESS row never). Parameters, for the keys in lock_key order: the lock keys, the idempotency
-- keys and the owner tokens each as one comma-separated text (they are `v2:` hex keys and UUIDs,
-- which hold no comma: one text parameter costs the client a join instead of a value per key),
-- the codes as an array; then, for name, type, run_key, lease_ms, max_attempts and backoff_ms, an
-- array and a value each: the array (one element per key) when the keys differ in that column,
-- else NULL and the one value all keys share (a burst's ticks share their run key, type and
-- timing). The lock keys are distinct and sorted (the caller checks both).
--
-- Exactly once per key, and no deadlock between replicas racing over overlapping key sets, as in
-- the lease's acquire_many and the single-tick acquire_attempt:
-- - `locked` locks every existing row that may be taken, in lock_key order, with SKIP LOCKED: a
--   row another transaction holds (a contender taking it over, its owner finishing it) is left
--   to that transaction and reported not acquired here, without waiting (the scheduler's next
--   offer of the tick, a retry or a catch-up, reads the row again).
-- - Each key finds its row through the lock_key index, one probe per key (`probe`, a LATERAL
--   subquery; the lock then finds the row by primary key, and `created` takes the keys `probe`
--   found no row for): as a join, a table that grew since it was last analyzed (a burst's own
--   rows) would be read whole and hashed by every statement, a cost growing with the table.
-- - `taken` updates only rows `locked` holds, found by primary key (it never waits), computing
--   attempts from the version it locked.
-- - `created` inserts the keys that had no row in the statement's snapshot, in lock_key order,
--   after `taken` (the count is a one-time filter evaluated before its first row); two
--   transactions inserting one key meet on the unique index and the second does nothing.
-- - `conflicted` reports those keys (id NULL): a row appeared after the snapshot. It may be a
--   skip record that a busy replica committed meanwhile, which this replica, free, must run:
--   the caller sends the statement once more for these keys, and its fresh snapshot takes a
--   skip row over by the rules above (SKIP LOCKED, no waiting). The skip row is not taken over
--   here (ON CONFLICT DO UPDATE): that would wait for a row lock held by another replica's
--   statement, which may itself wait in its own phase 2 for one of our inserts (a deadlock).
--   A single-key acquire_attempt takes it over in place (lease_ticks.sql).
WITH k AS (
    SELECT *
    FROM unnest(string_to_array(%s::text, ','), string_to_array(%s::text, ','), %b::text[],
                string_to_array(%s::text, ',')::uuid[])
        WITH ORDINALITY AS u (lock_key, idempotency_key, code, owner_token, i)
), v AS (
    SELECT k.lock_key, k.idempotency_key, k.code,
           coalesce((%b::text[])[k.i], %b::text) AS name,
           coalesce((%b::text[])[k.i], %b::text) AS type,
           coalesce((%b::text[])[k.i], %b::text) AS run_key,
           k.owner_token,
           coalesce((%b::bigint[])[k.i], %b::bigint) AS lease_ms,
           coalesce((%b::int[])[k.i], %b::int) AS max_attempts,
           coalesce((%b::float8[])[k.i], %b::float8) AS backoff_ms
    FROM k
), probe AS (
    SELECT v.*, j.row_id, j.takeable
    FROM v LEFT JOIN LATERAL (
        SELECT j.id AS row_id, {{tick_takeable}} AS takeable
        FROM {table} AS j WHERE j.lock_key = v.lock_key
    ) AS j ON true
), locked AS (
    SELECT j.id, v.owner_token, v.name, v.lease_ms
    FROM probe AS v CROSS JOIN LATERAL (
        SELECT j.id FROM {table} AS j
        WHERE v.takeable AND j.id = v.row_id AND {{tick_takeable}}
        FOR NO KEY UPDATE OF j SKIP LOCKED
    ) AS j
), taken AS (
    UPDATE {table} AS j
    SET {{takeover_set}},
        attempts = {{tick_attempts}}
    FROM locked AS l
    WHERE j.id = ANY (ARRAY(SELECT id FROM locked)) AND j.id = l.id
    RETURNING j.lock_key, j.id::text, j.fencing_token, j.idempotency_key, j.created_at,
              j.modified_at, j.attempts
), created AS (
    INSERT INTO {table} AS j ({{insert_columns}}, attempts)
    SELECT {{insert_values}}, 1
    FROM probe AS v
    WHERE v.row_id IS NULL
      AND (SELECT count(*) FROM taken) >= 0
    ORDER BY v.lock_key
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING j.lock_key, j.id::text, j.fencing_token, j.idempotency_key, j.created_at,
              j.modified_at, j.attempts
), conflicted AS (
    SELECT v.lock_key, NULL::text, NULL::bigint, NULL::text, NULL::timestamptz,
           NULL::timestamptz, NULL::int
    FROM probe AS v
    WHERE v.row_id IS NULL
      AND NOT EXISTS (SELECT FROM created AS c WHERE c.lock_key = v.lock_key)
)
SELECT * FROM taken UNION ALL SELECT * FROM created UNION ALL SELECT * FROM conflicted

-- name: read_owned_attempts
-- Resolves an ambiguous acquire_attempt or acquire_attempt_many: the rows that show our tokens
-- are the ones we won, with their attempt numbers. Parameters: the lock keys and the owner
-- tokens, pairwise. Rows: (lock_key, status, id, fencing_token, idempotency_key, created_at,
-- modified_at, attempts). Locks the rows it reports, so that it confirms only what a failover
-- keeps (see lease.sql, read_status).
SELECT j.lock_key, j.status, j.id::text, j.fencing_token, j.idempotency_key, j.created_at,
       j.modified_at, j.attempts
FROM {table} AS j
JOIN unnest(%b::text[], %b::uuid[]) AS v (lock_key, owner_token)
  ON j.lock_key = v.lock_key AND j.owner_token = v.owner_token
FOR KEY SHARE OF j
