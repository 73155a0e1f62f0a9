-- Pieces of SQL that several lease statements share (lease.sql, lease_ticks.sql, ticks.sql),
-- written once. A statement includes one with {{name}}; sdcore._internal.sql expands it, text
-- for text, when the file is read (before {table} and {sequence} are filled in). Each piece
-- names its inputs: `j` is the lease row, `v` what the contender sent (one row of the VALUES or
-- unnest), `l` the same inside an UPDATE's FROM (the row `locked` carries).

-- name: owner_expired
-- A RUNNING row whose *owner's* lease has passed by the database clock (its owner died). A row
-- last written by sdcore 0.1.0 has no lease_ms and falls back to the contender's.
(j.status = 'RUNNING'
 AND clock_timestamp() - j.modified_at
     > coalesce(j.lease_ms, v.lease_ms) * interval '1 millisecond')

-- name: plain_takeable
-- A row the plain acquire may take over: FAIL, or its owner's lease has passed.
(j.status = 'FAIL' OR {{owner_expired}})

-- name: tick_takeable
-- A row a scheduled tick's acquire may take over (the rules in sdcore/job_scheduler/_attempts.py):
-- its owner's lease has passed; FAIL released (column released); FAIL given back unstarted
-- (column given_back); FAIL with attempts left once the backoff since the failure has passed
-- (0 for a skipped tick). The caller's `data` is never read here: no payload can reopen a tick.
({{owner_expired}}
 OR (j.status = 'FAIL' AND j.released IS NOT NULL)
 OR (j.status = 'FAIL' AND j.given_back IS NOT NULL)
 OR (j.status = 'FAIL'
     AND j.attempts < v.max_attempts
     AND clock_timestamp() - j.modified_at >= CASE WHEN j.attempts = 0 THEN interval '0'
         ELSE LEAST(v.backoff_ms * power(2::float8, j.attempts - 1), 2147483647::float8)
              * interval '1 millisecond' END))

-- name: takeover_set
-- The SET list of every takeover: RUNNING for the new owner (its token, its name, its lease),
-- a fencing token from the table's sequence that is also above the row's own (a row written by a
-- 0.1.0 client), data and the reopen marks (released, given_back) cleared, modified by the
-- database clock.
status = 'RUNNING',
owner_token = l.owner_token,
fencing_token = greatest(nextval({sequence}), j.fencing_token + 1),
name = l.name,
data = NULL,
released = NULL,
given_back = NULL,
lease_ms = l.lease_ms,
modified_at = clock_timestamp()

-- name: tick_attempts
-- A tick takeover's attempt number: a new budget after an operator's release, the same attempt
-- for a run given back unstarted, else one more (an abandoned attempt counts).
CASE WHEN j.status = 'FAIL' AND j.released IS NOT NULL THEN 1
     WHEN j.status = 'FAIL' AND j.given_back IS NOT NULL THEN j.attempts
     ELSE j.attempts + 1 END

-- name: insert_columns
-- The columns a new RUNNING row is inserted with (insert_values gives their values from `v`;
-- the tick statements add attempts after them).
lock_key, idempotency_key, code, name, type, run_key, status, owner_token, fencing_token, data,
lease_ms, created_at, modified_at

-- name: insert_values
v.lock_key, v.idempotency_key, v.code, v.name, v.type, v.run_key, 'RUNNING', v.owner_token,
nextval({sequence}), NULL, v.lease_ms, clock_timestamp(), clock_timestamp()

-- name: skip_takeover
-- ON CONFLICT of a tick acquire's insert: a skip record (FAIL, attempts = 0) that another
-- replica, busy with the schedule's previous tick, committed while this insert was in flight is
-- taken over as the acquire would have taken it from its snapshot (attempts = 1). The condition
-- is checked on the newest committed version of the row; any other row (an acquire that won
-- the key) is left alone and the key is not acquired. `j` is the row, EXCLUDED what we sent.
DO UPDATE SET
    status = 'RUNNING',
    owner_token = EXCLUDED.owner_token,
    fencing_token = greatest(nextval({sequence}), j.fencing_token + 1),
    name = EXCLUDED.name,
    data = NULL,
    released = NULL,
    given_back = NULL,
    lease_ms = EXCLUDED.lease_ms,
    modified_at = clock_timestamp(),
    attempts = 1
WHERE j.status = 'FAIL' AND j.attempts = 0
