-- Statements of the schedules control plane (sdcore.scheduling._pg_store). Identifiers are filled
-- with psycopg's sql.SQL.format: {table} the schedules table, {seq} its revision sequence,
-- {replicas}, {declarations}, {actions}, {runs} its companion tables, {lease} the lease table.

-- name: lock
-- Every write of a schedule row or an action takes this transaction lock first: revisions and
-- action ids are then committed in the order they were drawn (pollers miss none).
SELECT pg_advisory_xact_lock(%s)

-- name: lock_shared
-- A replica's sync takes the write lock shared: syncs run side by side, but a create or remove
-- that decides whether a live replica declares a name waits for a sync in progress to commit its
-- declarations (and then sees them), instead of taking over a name that replica is declaring.
SELECT pg_advisory_xact_lock_shared(%s)

-- name: sync_schedules
-- One statement for every code-declared schedule of a replica (arrays of equal length). Only
-- new or changed definitions are written: a restart of the same code locks no row. A removed row
-- (a stored schedule removed, or a code schedule an operator removed once no replica declared
-- it) is taken over: the name is the code's again, with none of the old row's state.
INSERT INTO {table} AS s
    (name, origin, kind, expression, time_zone, options, fingerprint, day_rule)
SELECT u.n, 'code', u.k, u.e, u.z, u.o::jsonb, u.f, u.r
FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[])
     AS u(n, k, e, z, o, f, r)
LEFT JOIN {table} AS old ON old.name = u.n
WHERE old.name IS NULL OR old.removed_at IS NOT NULL
   OR (old.origin = 'code' AND old.fingerprint IS DISTINCT FROM u.f)
ON CONFLICT (name) DO UPDATE
SET origin = 'code', kind = EXCLUDED.kind, expression = EXCLUDED.expression,
    time_zone = EXCLUDED.time_zone, options = EXCLUDED.options,
    fingerprint = EXCLUDED.fingerprint, day_rule = EXCLUDED.day_rule,
    handler = NULL, args = NULL,
    paused = s.paused AND s.removed_at IS NULL,
    paused_at = CASE WHEN s.removed_at IS NULL THEN s.paused_at END,
    paused_by = CASE WHEN s.removed_at IS NULL THEN s.paused_by END,
    paused_reason = CASE WHEN s.removed_at IS NULL THEN s.paused_reason END,
    resumed_at = CASE WHEN s.removed_at IS NULL THEN s.resumed_at END,
    removed_at = NULL, updated_at = clock_timestamp()
WHERE s.removed_at IS NOT NULL
   OR (s.origin = 'code' AND s.fingerprint IS DISTINCT FROM EXCLUDED.fingerprint)

-- name: changed_names
-- Which of a replica's declared schedules are new, changed or removed (names and fingerprints
-- only: the full definitions are sent for these alone).
SELECT u.n
FROM unnest(%b::text[], %b::text[]) AS u(n, f)
LEFT JOIN {table} AS old ON old.name = u.n
WHERE old.name IS NULL OR old.removed_at IS NOT NULL
   OR (old.origin = 'code' AND old.fingerprint IS DISTINCT FROM u.f)

-- name: upsert_replica
INSERT INTO {replicas} AS r (replica_id, host, pid, handlers)
VALUES (%s::uuid, %s, %s, %s::text[])
ON CONFLICT (replica_id) DO UPDATE
SET handlers = EXCLUDED.handlers, last_seen = clock_timestamp()

-- name: declare
-- A declaration's definition is NULL while it is the row's (a code sync sends none: the row holds
-- it, and 10,000 definitions would double a restart's sync); keep_definitions fills it in when the
-- row moves on to another version. A stored schedule's declaration carries its definition.
INSERT INTO {declarations} AS d (schedule, replica_id, fingerprint, definition)
SELECT u.n, %s::uuid, u.f, u.d::jsonb FROM unnest(%b::text[], %b::text[], %b::text[]) AS u(n, f, d)
ON CONFLICT (schedule, replica_id) DO UPDATE
SET fingerprint = EXCLUDED.fingerprint,
    definition = coalesce(EXCLUDED.definition,
                          CASE WHEN d.fingerprint = EXCLUDED.fingerprint THEN d.definition END)

-- name: keep_definitions
-- Before a code sync changes these rows, the declarations of the definitions they held keep them:
-- during a rolling deploy other replicas still run those, and `list` shows every live version.
UPDATE {declarations} AS d
SET definition = jsonb_build_object('kind', s.kind, 'expression', s.expression,
                                    'time_zone', s.time_zone, 'day_rule', s.day_rule,
                                    'options', s.options)
FROM {table} AS s
WHERE s.name = ANY(%s::text[]) AND s.removed_at IS NULL AND d.schedule = s.name
  AND d.fingerprint = s.fingerprint AND d.definition IS NULL

-- name: undeclare
DELETE FROM {declarations} WHERE replica_id = %s::uuid AND schedule = %s

-- name: expire_replicas
DELETE FROM {replicas} WHERE last_seen < clock_timestamp() - %s::bigint * interval '1 millisecond'

-- name: mixed_versions
SELECT d.schedule
FROM {declarations} AS d JOIN {replicas} AS r USING (replica_id)
WHERE d.schedule = ANY(%s::text[])
  AND r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'
GROUP BY d.schedule HAVING count(DISTINCT d.fingerprint) > 1

-- name: heartbeat
UPDATE {replicas} SET last_seen = clock_timestamp() WHERE replica_id = %s::uuid

-- name: members
-- The heartbeat: mark this replica alive, record its digest, and read the live replicas with
-- theirs, in one statement. The SELECT reads the snapshot before the UPDATE: this replica's own
-- row shows as it was (its previous digest; absent if it had lapsed or was forgotten, and then
-- the caller syncs again).
WITH me AS (
    UPDATE {replicas} SET schedules_digest = %s, last_seen = clock_timestamp()
    WHERE replica_id = %s::uuid
)
SELECT replica_id::text, schedules_digest FROM {replicas}
WHERE last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'

-- name: declared_versions
-- The schedules (with their fingerprints) declared by the most recently seen replica with this
-- digest.
SELECT d.schedule, d.fingerprint FROM {declarations} AS d
WHERE d.replica_id = (SELECT r.replica_id FROM {replicas} AS r WHERE r.schedules_digest = %s
                      ORDER BY r.last_seen DESC LIMIT 1)

-- name: leave
-- Forget the replica (its declarations go with it) and wake the others: each reads the live
-- replicas again at once, so the ticks this replica owned find their other owners.
WITH gone AS (DELETE FROM {replicas} WHERE replica_id = %s::uuid RETURNING 1)
SELECT pg_notify(%s, 'members') FROM gone

-- name: revision
SELECT coalesce(max(revision), 0) FROM {table}

-- name: changes
-- A poll's one statement while nothing changes: the newest revision (the last entry of
-- revision_idx) and whether any action is open (the partial index of open actions).
SELECT coalesce((SELECT max(revision) FROM {table}), 0),
       EXISTS (SELECT 1 FROM {actions} WHERE finished_at IS NULL)

-- name: rows_since
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision, day_rule
FROM {table} WHERE revision > %s ORDER BY revision

-- name: rows_all
-- What a starting replica must know: the paused schedules, the stored ones, and those resumed
-- within the longest catch-up window (31 days: start-up catch-up runs what a pause skipped).
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision, day_rule
FROM {table}
WHERE removed_at IS NULL
  AND (paused OR origin = 'stored' OR resumed_at >= now() - %s::bigint * interval '1 millisecond')

-- name: row
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision, day_rule
FROM {table} WHERE name = %s

-- name: live_declarers
SELECT count(*) FROM {declarations} AS d JOIN {replicas} AS r USING (replica_id)
WHERE d.schedule = %s AND r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'

-- name: live_handlers
SELECT DISTINCT unnest(handlers) FROM {replicas}
WHERE last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'

-- name: pause
UPDATE {table}
SET paused = true, paused_at = clock_timestamp(), paused_by = %s, paused_reason = %s,
    revision = nextval({seq_text}::regclass), updated_at = clock_timestamp()
WHERE name = %s AND removed_at IS NULL AND NOT paused

-- name: resume
-- paused_at stays: replicas catch up the ticks between paused_at and resumed_at.
UPDATE {table}
SET paused = false, resumed_at = clock_timestamp(), paused_by = NULL, paused_reason = NULL,
    revision = nextval({seq_text}::regclass), updated_at = clock_timestamp()
WHERE name = %s AND removed_at IS NULL AND paused

-- name: store
-- Create (or re-create after removal) or change a stored schedule. A create (first parameter of
-- the WHERE) takes over only a removed row or a code schedule that no live replica declares, so of
-- two racing creates one is refused; an update gives the revision its definition was merged from,
-- and a change since refuses it, as does the lack of a row (an update never inserts one: the
-- SELECT's WHERE, whose parameters are the create flag and the name again). A taken-over row keeps
-- no pause history.
INSERT INTO {table} AS s
    (name, origin, kind, expression, time_zone, options, handler, args, fingerprint, revision,
     day_rule)
SELECT u.name, 'stored', u.kind, u.expression, u.time_zone, u.options::jsonb, u.handler,
       u.args::jsonb, u.fingerprint, nextval({seq_text}::regclass), u.day_rule
FROM (VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s))
     AS u(name, kind, expression, time_zone, options, handler, args, fingerprint, day_rule)
WHERE %s::boolean OR EXISTS (SELECT FROM {table} AS e WHERE e.name = %s)
ON CONFLICT (name) DO UPDATE
SET origin = 'stored', kind = EXCLUDED.kind, expression = EXCLUDED.expression,
    time_zone = EXCLUDED.time_zone, options = EXCLUDED.options, handler = EXCLUDED.handler,
    args = EXCLUDED.args, fingerprint = EXCLUDED.fingerprint, revision = EXCLUDED.revision,
    day_rule = EXCLUDED.day_rule, removed_at = NULL,
    paused = CASE WHEN s.removed_at IS NULL AND s.origin = 'stored' THEN s.paused ELSE false END,
    paused_at = CASE WHEN s.removed_at IS NULL AND s.origin = 'stored' THEN s.paused_at END,
    paused_by = CASE WHEN s.removed_at IS NULL AND s.origin = 'stored' THEN s.paused_by END,
    paused_reason = CASE WHEN s.removed_at IS NULL AND s.origin = 'stored' THEN s.paused_reason END,
    resumed_at = CASE WHEN s.removed_at IS NULL AND s.origin = 'stored' THEN s.resumed_at END,
    updated_at = clock_timestamp()
WHERE CASE WHEN %s
      THEN s.removed_at IS NOT NULL OR (s.origin <> 'stored' AND NOT EXISTS (
          SELECT FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
          WHERE x.schedule = s.name
            AND r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'))
      ELSE s.origin = 'stored' AND s.removed_at IS NULL AND s.revision = %s::bigint END

-- name: remove
-- A stored schedule, or a code schedule no live replica declares (dropped from the code): its
-- name is free again. A replica that still declares it takes it back at its next sync.
UPDATE {table} AS s
SET removed_at = clock_timestamp(), revision = nextval({seq_text}::regclass), updated_at = clock_timestamp()
WHERE name = %s AND removed_at IS NULL AND (origin = 'stored' OR NOT EXISTS (
    SELECT FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
    WHERE x.schedule = s.name
      AND r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'))

-- name: cancel_open_actions
-- A removed (or re-created) stored schedule's open trigger and backfill actions are closed in
-- the same transaction: a schedule created later under the name never runs them.
UPDATE {actions} SET finished_at = clock_timestamp(), outcome = 'CANCELLED'
WHERE schedule = %s AND finished_at IS NULL

-- name: insert_action
INSERT INTO {actions} (id, schedule, action, actor, reason, params, finished_at, outcome,
                       request_id)
VALUES (nextval({seq_text}::regclass), %s, %s, %s, %s, %s::jsonb,
        CASE WHEN %s THEN clock_timestamp() END, %s, %s)
RETURNING id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at,
          request_id

-- name: notify
SELECT pg_notify(%s, %s)

-- name: open_actions
-- Every open trigger/backfill (a few rows, on the partial index); each replica keeps its own.
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at,
       request_id
FROM {actions}
WHERE finished_at IS NULL ORDER BY id

-- name: action_of_request
-- The action a client's request id already recorded (under the write lock: a retry racing its
-- first attempt finds it; the unique index is the backstop).
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at,
       request_id
FROM {actions} WHERE schedule = %s AND request_id = %s

-- name: action
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at,
       request_id
FROM {actions} WHERE id = %s

-- name: actions_of
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at,
       request_id
FROM {actions} WHERE schedule = %s ORDER BY id DESC LIMIT %s

-- name: finish_action
-- An action a remove closed (CANCELLED) still takes its coordinator's final CANCELLED progress
-- (remove writes none; the coordinator ends right after it): close time and outcome stay.
-- Parameters: outcome, progress, id, outcome.
UPDATE {actions}
SET finished_at = coalesce(finished_at, clock_timestamp()),
    outcome = CASE WHEN finished_at IS NULL THEN %s ELSE outcome END,
    progress = coalesce(%s::jsonb, progress)
WHERE id = %s AND (finished_at IS NULL OR (outcome = 'CANCELLED' AND %s = 'CANCELLED'))

-- name: progress
UPDATE {actions} SET progress = %s::jsonb WHERE id = %s AND finished_at IS NULL

-- name: release_failed
-- Backfill reopens ticks that failed before it was requested (and only those: a tick that fails
-- during the backfill is not reopened again by a replica that takes the backfill over).
-- The mark is the lease's column released (migration lease/0007), never the run's data.
UPDATE {lease}
SET released = %s::text
WHERE lock_key = ANY(%s::text[]) AND status = 'FAIL' AND attempts > 0 AND modified_at < %s
  AND released IS NULL

-- name: succeeded_before
-- What had succeeded when a backfill was requested (by the database clock, as the request's
-- created_at): stable whoever coordinates, and whenever.
SELECT lock_key FROM {lease}
WHERE lock_key = ANY(%s::text[]) AND status = 'SUCCESS' AND modified_at < %s

-- name: runs_started
-- Run starts, several at once; their ids in the order given: the rows are inserted in that order
-- and the identity draws each id as its row is inserted, so the ids sorted are in that order.
-- A run under a newer fencing token means the tick was taken over: its earlier attempts still
-- RUNNING will never finish (their replica died or lost the lease), so they are closed here, those
-- recorded before and those of this statement alike (the latter are inserted closed: the UPDATE
-- does not see the rows its own statement inserts). Rows are locked in id order, as runs_finished
-- locks them, so that a takeover and a superseded replica's finishes never wait on each other.
-- Parameters (arrays, one element per run): schedule, run_key, source, scheduled_at, attempt,
-- fencing_token, replica_id, host, pid.
WITH given AS (
    SELECT *
    FROM unnest(%b::text[], %b::text[], %b::text[], %b::timestamptz[], %b::integer[],
                %b::bigint[], %b::uuid[], %b::text[], %b::integer[])
         WITH ORDINALITY AS u(schedule, run_key, source, scheduled_at, attempt, fencing_token,
                              replica_id, host, pid, ord)
), newest AS (
    SELECT schedule, run_key, max(fencing_token) AS fencing_token
    FROM given GROUP BY schedule, run_key
), started AS (
    INSERT INTO {runs} (schedule, run_key, source, scheduled_at, attempt, fencing_token,
                        replica_id, host, pid, status, finished_at, error)
    SELECT g.schedule, g.run_key, g.source, g.scheduled_at, g.attempt, g.fencing_token,
           g.replica_id, g.host, g.pid,
           CASE WHEN g.fencing_token < n.fencing_token THEN 'FAIL' ELSE 'RUNNING' END,
           CASE WHEN g.fencing_token < n.fencing_token THEN clock_timestamp() END,
           CASE WHEN g.fencing_token < n.fencing_token
                THEN 'abandoned: the tick was taken over (fencing token ' || n.fencing_token || ')'
           END
    FROM given AS g JOIN newest AS n USING (schedule, run_key)
    ORDER BY g.ord
    RETURNING id
), abandoned AS (
    UPDATE {runs} AS r
    SET status = 'FAIL', finished_at = clock_timestamp(),
        error = 'abandoned: the tick was taken over (fencing token ' || old.newer || ')'
    FROM (
        SELECT o.id, n.fencing_token AS newer
        FROM {runs} AS o JOIN newest AS n USING (schedule, run_key)
        WHERE o.status = 'RUNNING' AND o.fencing_token < n.fencing_token
        ORDER BY o.id
        FOR UPDATE OF o
    ) AS old
    WHERE r.id = old.id AND r.status = 'RUNNING'
)
SELECT id FROM started ORDER BY id

-- name: runs_finished
-- Only runs still RUNNING: one a takeover closed as abandoned stays so (its handler may still
-- return on the superseded replica, whose lease completion is then refused). A run whose lease
-- row already carries a newer fencing token was taken over too, though the takeover's start may
-- not be recorded yet: it is closed as abandoned, whatever its handler returned. Rows are locked
-- in id order (see runs_started).
-- Parameters (arrays, one element per run): id, status, error, lease row id (or NULL).
UPDATE {runs} AS r
SET finished_at = clock_timestamp(),
    status = CASE WHEN done.newer IS NULL THEN done.status ELSE 'FAIL' END,
    error = CASE WHEN done.newer IS NULL THEN done.error
                 ELSE 'abandoned: the tick was taken over (fencing token ' || done.newer || ')'
            END
FROM (
    SELECT o.id, u.status, u.error,
           CASE WHEN l.fencing_token > o.fencing_token THEN l.fencing_token END AS newer
    FROM unnest(%b::bigint[], %b::text[], %b::text[], %b::uuid[]) AS u(id, status, error, lease)
    JOIN {runs} AS o ON o.id = u.id
    LEFT JOIN {lease} AS l ON l.id = u.lease
    WHERE o.status = 'RUNNING'
    ORDER BY o.id
    FOR UPDATE OF o
) AS done
WHERE r.id = done.id AND r.status = 'RUNNING'

-- name: history
SELECT schedule, run_key, source, scheduled_at, started_at, finished_at, status, attempt,
       fencing_token, host, pid, error
FROM {runs} WHERE schedule = %s ORDER BY started_at DESC, id DESC LIMIT %s

-- name: list
-- Who paused and why only while paused (the row keeps paused_at for the resume's catch-up).
SELECT s.name, s.origin, s.kind, s.expression, s.time_zone, s.paused,
       CASE WHEN s.paused THEN s.paused_at END, CASE WHEN s.paused THEN s.paused_by END,
       CASE WHEN s.paused THEN s.paused_reason END, s.handler, s.args, s.options,
       coalesce(d.replicas, ARRAY[]::text[]), coalesce(d.versions, 0),
       lr.started_at, lr.status, d.last_seen, s.day_rule, s.revision
FROM {table} AS s
LEFT JOIN LATERAL (
    SELECT array_agg(r.host || ':' || r.pid ORDER BY r.host, r.pid) AS replicas,
           count(DISTINCT x.fingerprint) AS versions,
           max(r.last_seen) AS last_seen
    FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
    WHERE x.schedule = s.name
      AND r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'
) AS d ON true
LEFT JOIN LATERAL (
    SELECT started_at, status FROM {runs} WHERE schedule = s.name
    ORDER BY started_at DESC, id DESC LIMIT 1
) AS lr ON true
WHERE s.removed_at IS NULL
ORDER BY s.name

-- name: live_versions
-- Each definition live replicas declare, with its replicas (several during a rolling deploy): the
-- declaration's own, else the row's when the fingerprints agree (NULL: unknown, e.g. declared by
-- a replica of an sdcore that does not record definitions).
SELECT x.schedule, x.fingerprint,
       coalesce((array_agg(x.definition) FILTER (WHERE x.definition IS NOT NULL))[1],
                CASE WHEN x.fingerprint = s.fingerprint THEN
                    jsonb_build_object('kind', s.kind, 'expression', s.expression,
                                       'time_zone', s.time_zone, 'day_rule', s.day_rule,
                                       'options', s.options)
                END),
       array_agg(r.host || ':' || r.pid ORDER BY r.host, r.pid)
FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
LEFT JOIN {table} AS s ON s.name = x.schedule
WHERE r.last_seen >= clock_timestamp() - %s::bigint * interval '1 millisecond'
GROUP BY x.schedule, x.fingerprint, s.name
ORDER BY x.schedule, min(r.started_at), x.fingerprint

-- name: prune_runs
DELETE FROM {runs} WHERE id IN (SELECT id FROM {runs} WHERE started_at < %s LIMIT %s)

-- name: prune_actions
DELETE FROM {actions} WHERE id IN (
    SELECT id FROM {actions} WHERE finished_at IS NOT NULL AND finished_at < %s LIMIT %s)
