-- Read statements of the web dashboard (sdcore.dashboard). Identifiers are filled with psycopg's
-- sql.SQL.format: {schedules} the schedules table, {replicas}, {declarations}, {runs} its
-- companion tables, {lease} the lease table. Values are parameters. The outbox page's rows come
-- from OutboxAdmin (outbox.sql).
-- Every page reads one page of rows (LIMIT), never the whole table: 10,000 schedules and a
-- million runs answer in milliseconds on the existing indexes.

-- name: schedules_page
-- One page of live schedules by name (the primary key's order), with who declares each one now
-- and its last run: one probe of runs (schedule, started_at DESC) per row of the page.
WITH page AS (
    SELECT s.name, s.origin, s.kind, s.expression, s.time_zone, s.paused, s.paused_at,
           s.paused_by, s.paused_reason, s.options, s.created_at, s.day_rule
    FROM {schedules} AS s
    WHERE s.removed_at IS NULL
      AND (%(query)s::text IS NULL OR strpos(lower(s.name), lower(%(query)s::text)) > 0)
      AND (%(paused)s::boolean IS NULL OR s.paused = %(paused)s::boolean)
    ORDER BY s.name
    LIMIT %(limit)s OFFSET %(offset)s
)
SELECT p.name, p.origin, p.kind, p.expression, p.time_zone, p.paused, p.paused_at, p.paused_by,
       p.paused_reason, p.options, p.created_at, p.day_rule,
       coalesce(d.replicas, 0), lr.started_at, lr.status, lr.error
FROM page AS p
LEFT JOIN LATERAL (
    SELECT count(*) AS replicas
    FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
    WHERE x.schedule = p.name
      AND r.last_seen >= clock_timestamp() - %(live_ms)s::bigint * interval '1 millisecond'
) AS d ON true
LEFT JOIN LATERAL (
    SELECT started_at, status, error FROM {runs} WHERE schedule = p.name
    ORDER BY started_at DESC, id DESC LIMIT 1
) AS lr ON true
ORDER BY p.name

-- name: schedule_counts
-- The headline numbers and the pager's total, in one scan (a window count(*) OVER () on the page
-- query would read and sort every matching row before the LIMIT, growing with the table).
SELECT count(*), count(*) FILTER (WHERE paused),
       count(*) FILTER (
           WHERE (%(query)s::text IS NULL OR strpos(lower(name), lower(%(query)s::text)) > 0)
             AND (%(paused)s::boolean IS NULL OR paused = %(paused)s::boolean))
FROM {schedules} WHERE removed_at IS NULL

-- name: schedule_one
SELECT s.name, s.origin, s.kind, s.expression, s.time_zone, s.paused, s.paused_at, s.paused_by,
       s.paused_reason, s.options, s.created_at, s.day_rule,
       (SELECT count(*) FROM {declarations} AS x JOIN {replicas} AS r USING (replica_id)
        WHERE x.schedule = s.name
          AND r.last_seen >= clock_timestamp() - %(live_ms)s::bigint * interval '1 millisecond'),
       lr.started_at, lr.status, lr.error
FROM {schedules} AS s
LEFT JOIN LATERAL (
    SELECT started_at, status, error FROM {runs} WHERE schedule = s.name
    ORDER BY started_at DESC, id DESC LIMIT 1
) AS lr ON true
WHERE s.name = %(name)s AND s.removed_at IS NULL

-- name: cron_calendars
-- The distinct (expression, zone) pairs of live cron schedules, most used first: what the
-- calendar warms when the dashboard starts (one scan of the schedules table).
SELECT expression, time_zone FROM {schedules}
WHERE removed_at IS NULL AND kind = 'cron'
GROUP BY expression, time_zone
ORDER BY count(*) DESC, expression, time_zone
LIMIT %(limit)s

-- name: tick_buckets
-- Ticks of these schedules that ran in the window, per hour bucket: distinct scheduled instants
-- that succeeded (in any attempt), are still running, or only failed. Runs started by `trigger`
-- are not ticks and are left out; a backfilled tick counts (it is no longer missed). Only the
-- instants the timeline expects are counted: from the schedule's creation (a backfill may reach
-- further back) to %(until)s (the grace before now), and for an interval schedule on its grid;
-- a count above the calendar's is resolved against it by tick_instants. The started_at bound
-- keeps the scan on the (schedule, started_at DESC) index: a tick starts after it was due.
SELECT schedule, b,
       count(*) FILTER (WHERE ok),
       count(*) FILTER (WHERE NOT ok AND running),
       count(*) FILTER (WHERE NOT ok AND NOT running)
FROM (
    SELECT r.schedule, r.scheduled_at,
           floor(extract(epoch FROM r.scheduled_at - %(since)s::timestamptz) / %(bucket_s)s)::int
               AS b,
           bool_or(r.status = 'SUCCESS') AS ok, bool_or(r.status = 'RUNNING') AS running
    FROM {runs} AS r
    JOIN {schedules} AS s ON s.name = r.schedule
    WHERE r.schedule = ANY(%(names)s::text[])
      AND r.started_at >= %(since)s::timestamptz
      AND r.scheduled_at >= %(since)s::timestamptz AND r.scheduled_at < %(until)s::timestamptz
      AND r.scheduled_at >= s.created_at
      AND r.source <> 'trigger'
      AND CASE WHEN s.kind = 'interval' AND s.expression ~ '^[1-9][0-9]*$'
                    AND length(s.expression) <= 18
               THEN mod((extract(epoch FROM r.scheduled_at) * 1000)::numeric,
                        s.expression::numeric) = 0
               ELSE true END
    GROUP BY r.schedule, r.scheduled_at
) AS ticks
GROUP BY schedule, b

-- name: tick_instants
-- One schedule's distinct ticks in [low, high) with their outcome, for an hour whose count in
-- tick_buckets exceeds the calendar's (ticks of an earlier expression or zone): the caller keeps
-- the instants its calendar expects.
SELECT scheduled_at, bool_or(status = 'SUCCESS'), bool_or(status = 'RUNNING')
FROM {runs}
WHERE schedule = %(name)s AND started_at >= %(low)s::timestamptz
  AND scheduled_at >= %(low)s::timestamptz AND scheduled_at < %(high)s::timestamptz
  AND source <> 'trigger'
GROUP BY scheduled_at

-- name: runs_of
SELECT run_key, source, scheduled_at, started_at, finished_at, status, attempt, fencing_token,
       host, pid, error
FROM {runs} WHERE schedule = %(name)s
ORDER BY started_at DESC, id DESC LIMIT %(limit)s

-- name: lease_details
-- What LeaseAdmin does not show of RUNNING rows: the lease length each owner asked for, and the
-- owner (host:pid) from the run history of schedule ticks (the owner token itself never leaves
-- the database). An INITIAL lease has no run key; its history rows say 'initial'.
SELECT j.id::text, j.lease_ms, o.host, o.pid
FROM {lease} AS j
LEFT JOIN LATERAL (
    SELECT r.host, r.pid FROM {runs} AS r
    WHERE r.schedule = j.code AND r.run_key = coalesce(j.run_key, 'initial')
      AND r.fencing_token = j.fencing_token
    ORDER BY r.started_at DESC LIMIT 1
) AS o ON true
WHERE j.id = ANY(%(ids)s::uuid[])
