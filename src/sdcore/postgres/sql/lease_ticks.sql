-- Scheduler tick statements on the lease table (sdcore.job_scheduler._attempts; used by
-- sdcore.scheduling only). {table} and {sequence} as in lease.sql. A scheduled tick keeps a
-- retry budget on its row (column attempts, migration lease/0003): max_attempts runs across the
-- cluster, each after a backoff.

-- name: acquire_attempt
-- The rules of lease.sql's `acquire` (a new row is RUNNING; a takeover rotates the owner token,
-- draws a higher fencing token, records the new owner's lease_ms, clears data; a loser facing a
-- row that is plainly not takeable takes no lock and writes nothing; a row that looks takeable
-- is locked with SKIP LOCKED; a new key is inserted only under its advisory lock), with the
-- budget:
-- - no row: insert it, attempts = 1;
-- - RUNNING silent for longer than its owner's lease (its owner died): take it, attempts + 1
--   (an abandoned attempt is re-run whatever the budget);
-- - FAIL released (column released: by its owner, an operator, a backfill or a restart of an
--   initial job): take it and start a new budget, attempts = 1;
-- - FAIL given back unstarted by the acquire that won it (column given_back): take it, same
--   attempts (that attempt never ran);
-- - FAIL otherwise: take it only while attempts < max_attempts and once
--   backoff_ms * 2 ^ (attempts - 1) (at most 2147483647 ms; 0 for a skipped tick, whose
--   attempts is 0) has passed since the failure by the database clock;
-- - SUCCESS: never.
-- A skip record (record_skipped) that a busy replica commits while our insert of the key waits
-- on it is taken over (skip_takeover in fragments.sql): the free replica runs the tick. The row
-- lock it may then wait for is held by a contender taking over that skip row, which waits for
-- nothing of ours (one key), so no deadlock.
-- Parameters: lock_key, idempotency_key, code, name, type, run_key, owner_token, lease_ms,
-- max_attempts, backoff_ms.
WITH v (lock_key, idempotency_key, code, name, type, run_key, owner_token, lease_ms,
        max_attempts, backoff_ms) AS (
    VALUES (%s::text, %s::text, %s::text, %s::text, %s::text, %s::text, %s::uuid, %s::bigint,
            %s::int, %s::float8)
), locked AS (
    SELECT j.id
    FROM {table} AS j, v
    WHERE j.lock_key = v.lock_key
      AND {{tick_takeable}}
    FOR NO KEY UPDATE OF j SKIP LOCKED
), taken AS (
    UPDATE {table} AS j
    SET {{takeover_set}},
        attempts = {{tick_attempts}}
    FROM v AS l, locked
    WHERE j.id = locked.id
    RETURNING j.id::text, j.fencing_token, j.idempotency_key, j.created_at, j.modified_at,
              j.attempts
), created AS (
    INSERT INTO {table} AS j ({{insert_columns}}, attempts)
    SELECT {{insert_values}}, 1
    FROM v
    WHERE NOT EXISTS (SELECT FROM {table} AS e WHERE e.lock_key = v.lock_key)
      AND pg_try_advisory_xact_lock(hashtextextended(v.lock_key, 0))
    ON CONFLICT (lock_key) {{skip_takeover}}
    RETURNING j.id::text, j.fencing_token, j.idempotency_key, j.created_at, j.modified_at,
              j.attempts
)
SELECT * FROM taken UNION ALL SELECT * FROM created

-- name: record_skipped
-- A tick skipped on purpose (overlap): a FAIL row with attempts = 0 and data.skipped = reason,
-- only if the tick has no row yet. Any replica's acquire_attempt may still take it (a replica
-- that is not busy), also one whose insert of the key was in flight when it committed
-- (skip_takeover), so a skip record never costs a run that a free replica would have made; the
-- catch-up sweep and missed_ticks see that it was skipped, not missed.
INSERT INTO {table}
    (lock_key, idempotency_key, code, name, type, run_key, status, owner_token,
     fencing_token, data, created_at, modified_at, attempts)
VALUES (%s, %s, %s, %s, %s, %s, 'FAIL', %s::uuid, nextval({sequence}), %s::jsonb,
        clock_timestamp(), clock_timestamp(), 0)
ON CONFLICT (lock_key) DO NOTHING

-- name: tick_records
-- The skip reason is read only from a skip record (attempts = 0, which no finalize writes); the
-- reopen marks only from their columns, never from the caller's data.
SELECT lock_key, status, attempts, CASE WHEN j.attempts = 0 THEN j.data ->> 'skipped' END,
       j.status = 'FAIL' AND j.released IS NOT NULL,
       extract(epoch FROM clock_timestamp() - j.modified_at)::float8 * 1000,
       j.status = 'FAIL' AND j.given_back IS NOT NULL,
       j.given_back
FROM {table} AS j WHERE lock_key = ANY(%b)

-- name: reopen_initial
-- A new process start reopens a failed initial job (column released = 'restart'): its next
-- tick acquire takes it with a new attempt budget. A row already reopened, or given back, is
-- left as it is. Parameter: lock_key.
UPDATE {table} AS j SET released = 'restart'
WHERE j.lock_key = %s AND j.type = 'INITIAL' AND j.status = 'FAIL'
  AND j.released IS NULL AND j.given_back IS NULL

-- name: first_seen
-- When did a schedule first leave a row (catch-up never reaches back before it)?
SELECT min(created_at) FROM {table} WHERE code = %s

-- name: first_seen_many
-- first_seen for many schedules in one statement: each code that has a row, with its oldest
-- row's created_at (one probe of the (code, created_at) index per code).
SELECT c.code, f.first
FROM unnest(%b::text[]) AS c(code)
CROSS JOIN LATERAL (SELECT min(j.created_at) AS first FROM {table} AS j WHERE j.code = c.code) AS f
WHERE f.first IS NOT NULL
