-- Statements of the schedules control plane (sdcore.scheduling._pg_store). Identifiers are filled
-- with psycopg's sql.SQL.format: {table} the schedules table, {seq} its revision sequence,
-- {replicas}, {declarations}, {actions}, {runs} its companion tables, {lease} the lease table.

-- name: lock
-- Every write of a schedule row or an action takes this transaction lock first: revisions and
-- action ids are then committed in the order they were drawn (pollers miss none).
SELECT pg_advisory_xact_lock(%s)

-- name: sync_schedules
-- One statement for every code-declared schedule of a replica (arrays of equal length). Only
-- new or changed definitions are written: a restart of the same code locks no row.
INSERT INTO {table} AS s (name, origin, kind, expression, time_zone, options, fingerprint)
SELECT u.n, 'code', u.k, u.e, u.z, u.o::jsonb, u.f
FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[])
     AS u(n, k, e, z, o, f)
LEFT JOIN {table} AS old ON old.name = u.n
WHERE old.name IS NULL OR (old.origin = 'code' AND old.fingerprint IS DISTINCT FROM u.f)
ON CONFLICT (name) DO UPDATE
SET kind = EXCLUDED.kind, expression = EXCLUDED.expression, time_zone = EXCLUDED.time_zone,
    options = EXCLUDED.options, fingerprint = EXCLUDED.fingerprint,
    updated_at = clock_timestamp()
WHERE s.origin = 'code' AND s.fingerprint IS DISTINCT FROM EXCLUDED.fingerprint

-- name: changed_names
-- Which of a replica's declared schedules are new or changed (names and fingerprints only: the
-- full definitions are sent for these alone).
SELECT u.n
FROM unnest(%s::text[], %s::text[]) AS u(n, f)
LEFT JOIN {table} AS old ON old.name = u.n
WHERE old.name IS NULL OR (old.origin = 'code' AND old.fingerprint IS DISTINCT FROM u.f)

-- name: upsert_replica
INSERT INTO {replicas} AS r (replica_id, host, pid, handlers)
VALUES (%s::uuid, %s, %s, %s::text[])
ON CONFLICT (replica_id) DO UPDATE
SET handlers = EXCLUDED.handlers, last_seen = clock_timestamp()

-- name: declare
INSERT INTO {declarations} AS d (schedule, replica_id, fingerprint)
SELECT u.n, %s::uuid, u.f FROM unnest(%s::text[], %s::text[]) AS u(n, f)
ON CONFLICT (schedule, replica_id) DO UPDATE SET fingerprint = EXCLUDED.fingerprint

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

-- name: leave
DELETE FROM {replicas} WHERE replica_id = %s::uuid

-- name: revision
SELECT coalesce(max(revision), 0) FROM {table}

-- name: rows_since
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision
FROM {table} WHERE revision > %s ORDER BY revision

-- name: rows_all
-- What a starting replica must know: the paused schedules and the stored ones.
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision
FROM {table} WHERE removed_at IS NULL AND (paused OR origin = 'stored')

-- name: row
SELECT name, origin, kind, expression, time_zone, options, handler, args, fingerprint, paused,
       paused_at, resumed_at, removed_at, revision
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
UPDATE {table}
SET paused = false, resumed_at = clock_timestamp(), revision = nextval({seq_text}::regclass),
    updated_at = clock_timestamp()
WHERE name = %s AND removed_at IS NULL AND paused

-- name: store
-- Create (or re-create after removal) or change a stored schedule; never a code schedule.
INSERT INTO {table} AS s
    (name, origin, kind, expression, time_zone, options, handler, args, fingerprint, revision)
VALUES (%s, 'stored', %s, %s, %s, %s::jsonb, %s, %s::jsonb, %s, nextval({seq_text}::regclass))
ON CONFLICT (name) DO UPDATE
SET kind = EXCLUDED.kind, expression = EXCLUDED.expression, time_zone = EXCLUDED.time_zone,
    options = EXCLUDED.options, handler = EXCLUDED.handler, args = EXCLUDED.args,
    fingerprint = EXCLUDED.fingerprint, revision = EXCLUDED.revision, removed_at = NULL,
    paused = CASE WHEN s.removed_at IS NULL THEN s.paused ELSE false END,
    updated_at = clock_timestamp()
WHERE s.origin = 'stored'

-- name: remove
UPDATE {table}
SET removed_at = clock_timestamp(), revision = nextval({seq_text}::regclass), updated_at = clock_timestamp()
WHERE name = %s AND origin = 'stored' AND removed_at IS NULL

-- name: insert_action
INSERT INTO {actions} (id, schedule, action, actor, reason, params, finished_at, outcome)
VALUES (nextval({seq_text}::regclass), %s, %s, %s, %s, %s::jsonb,
        CASE WHEN %s THEN clock_timestamp() END, %s)
RETURNING id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at

-- name: notify
SELECT pg_notify(%s, %s)

-- name: open_actions
-- Every open trigger/backfill (a few rows, on the partial index); each replica keeps its own.
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at
FROM {actions}
WHERE finished_at IS NULL ORDER BY id

-- name: action
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at
FROM {actions} WHERE id = %s

-- name: actions_of
SELECT id, schedule, action, actor, reason, params, progress, outcome, created_at, finished_at
FROM {actions} WHERE schedule = %s ORDER BY id DESC LIMIT %s

-- name: finish_action
UPDATE {actions} SET finished_at = clock_timestamp(), outcome = %s,
       progress = coalesce(%s::jsonb, progress)
WHERE id = %s AND finished_at IS NULL

-- name: progress
UPDATE {actions} SET progress = %s::jsonb WHERE id = %s AND finished_at IS NULL

-- name: release_failed
-- Backfill reopens ticks that failed before it was requested (and only those: a tick that fails
-- during the backfill is not reopened again by a replica that takes the backfill over).
UPDATE {lease}
SET data = coalesce(data, jsonb_build_object()) || jsonb_build_object('released_by', %s::text)
WHERE lock_key = ANY(%s::text[]) AND status = 'FAIL' AND attempts > 0 AND modified_at < %s
  AND NOT (coalesce(data, jsonb_build_object()) ? 'released_by')

-- name: run_started
-- A run under a newer fencing token means the tick was taken over: its earlier attempts still
-- RUNNING will never finish (their replica died or lost the lease), so they are closed here.
WITH started AS (
    INSERT INTO {runs} (schedule, run_key, source, scheduled_at, attempt, fencing_token,
                        replica_id, host, pid)
    VALUES (%s, %s, %s, %s, %s, %s, %s::uuid, %s, %s)
    RETURNING id, schedule, run_key, fencing_token
), abandoned AS (
    UPDATE {runs} AS r
    SET status = 'FAIL', finished_at = clock_timestamp(),
        error = 'abandoned: the tick was taken over (fencing token ' || s.fencing_token || ')'
    FROM started AS s
    WHERE r.schedule = s.schedule AND r.run_key = s.run_key AND r.status = 'RUNNING'
      AND r.fencing_token < s.fencing_token
)
SELECT id FROM started

-- name: run_finished
UPDATE {runs} SET finished_at = clock_timestamp(), status = %s, error = %s WHERE id = %s

-- name: history
SELECT schedule, run_key, source, scheduled_at, started_at, finished_at, status, attempt,
       fencing_token, host, pid, error
FROM {runs} WHERE schedule = %s ORDER BY started_at DESC, id DESC LIMIT %s

-- name: list
SELECT s.name, s.origin, s.kind, s.expression, s.time_zone, s.paused, s.paused_at, s.paused_by,
       s.paused_reason, s.handler, s.args, s.options,
       coalesce(d.replicas, ARRAY[]::text[]), coalesce(d.versions, 0),
       lr.started_at, lr.status, d.last_seen
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

-- name: prune_runs
DELETE FROM {runs} WHERE id IN (SELECT id FROM {runs} WHERE started_at < %s LIMIT %s)

-- name: prune_actions
DELETE FROM {actions} WHERE id IN (
    SELECT id FROM {actions} WHERE finished_at IS NOT NULL AND finished_at < %s LIMIT %s)
