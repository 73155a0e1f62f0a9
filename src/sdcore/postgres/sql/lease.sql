-- The lease statements (sdcore.job_scheduler.JobSchedulerService), rendered once per table.
-- {table} is the quoted table, {sequence} its fencing sequence as a regclass literal; every value
-- is a parameter. Every timestamp comes from clock_timestamp(): the database clock at statement
-- time, never the application's clock and never the transaction start (now()), which gave two
-- owners when a statement ran late in an old transaction (RESEARCH.md).

-- name: acquire_many
-- acquire for many run keys in one statement (the burst of ticks due at one instant). Each key
-- follows the rules of `acquire`: a new key is inserted RUNNING; a FAIL row, or a RUNNING row
-- whose *owner's* lease has passed by the database clock, is taken over (owner token rotated,
-- fencing token drawn from the sequence, data cleared, the new owner's lease_ms recorded); a
-- SUCCESS row is never taken. Parameters: one array per column, in the same order
-- (lock_key, idempotency_key, code, name, type, run_key, owner_token, lease_ms); the lock keys
-- are distinct and sorted (the caller checks both).
--
-- Exactly once per key, and no deadlock between replicas that race over overlapping key sets:
-- - `locked` takes the row lock of every existing row that may be taken, in lock_key order
--   (LockRows runs above the Sort). A row another transaction holds is waited for, and
--   re-checked on its newest version (READ COMMITTED): a row a concurrent winner took is
--   dropped, so of two contenders only the first to lock it updates it.
-- - `taken` updates only rows `locked` holds: it never waits.
-- - `created` inserts the keys that had no row in the statement's snapshot, in lock_key order;
--   two transactions inserting one key meet on the unique index, and the second does nothing.
-- - `created` first counts `taken` (a one-time filter, evaluated before its first row), so
--   every transaction takes its row locks (phase 1, sorted) before its inserts (phase 2,
--   sorted). A wait in phase 1 is on a row lock, held by a single-row statement or by another
--   transaction in phase 1 or later whose locks were taken in the same order; a wait in phase 2
--   is on an uncommitted insert of a transaction also in phase 2 and behind in key order. No
--   cycle can form, so no deadlock aborts a whole batch.
WITH v AS (
    SELECT *
    FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[],
                %s::uuid[], %s::bigint[])
        AS v (lock_key, idempotency_key, code, name, type, run_key, owner_token, lease_ms)
), locked AS (
    SELECT j.id, v.owner_token, v.name, v.lease_ms
    FROM {table} AS j JOIN v ON j.lock_key = v.lock_key
    WHERE j.status = 'FAIL'
       OR (j.status = 'RUNNING'
           AND clock_timestamp() - j.modified_at
               > coalesce(j.lease_ms, v.lease_ms) * interval '1 millisecond')
    ORDER BY j.lock_key
    FOR UPDATE OF j
), taken AS (
    UPDATE {table} AS j
    SET status = 'RUNNING',
        owner_token = l.owner_token,
        fencing_token = greatest(nextval({sequence}), j.fencing_token + 1),
        name = l.name,
        data = NULL,
        lease_ms = l.lease_ms,
        modified_at = clock_timestamp()
    FROM locked AS l
    WHERE j.id = l.id
    RETURNING {columns_j}
), created AS (
    INSERT INTO {table}
        (lock_key, idempotency_key, code, name, type, run_key, status, owner_token,
         fencing_token, data, lease_ms, created_at, modified_at)
    SELECT v.lock_key, v.idempotency_key, v.code, v.name, v.type, v.run_key, 'RUNNING',
           v.owner_token, nextval({sequence}), NULL, v.lease_ms, clock_timestamp(),
           clock_timestamp()
    FROM v
    WHERE NOT EXISTS (SELECT FROM {table} AS e WHERE e.lock_key = v.lock_key)
      AND (SELECT count(*) FROM taken) >= 0
    ORDER BY v.lock_key
    ON CONFLICT (lock_key) DO NOTHING
    RETURNING {columns}
)
SELECT * FROM taken UNION ALL SELECT * FROM created

-- name: read_owned_many
-- Resolves an ambiguous acquire_many: the rows that show our tokens are the ones we won.
-- Parameters: the lock keys and the owner tokens, pairwise.
SELECT {columns_j}
FROM {table} AS j
JOIN unnest(%s::text[], %s::uuid[]) AS v (lock_key, owner_token)
  ON j.lock_key = v.lock_key AND j.owner_token = v.owner_token
