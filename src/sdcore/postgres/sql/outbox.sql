-- The outbox statements (sdcore.outbox: Outbox, PostgresOutboxStore). {table} is the quoted
-- table; values are always parameters. Every timestamp is clock_timestamp(), the database clock.
-- Statements of the write path (enqueue, existing) use psycopg's named placeholders, %(name)s,
-- and CAST(… AS type) rather than "::type", so that SQLAlchemy text() (":name") runs the same
-- text; the relay's statements use positional %s. listen is the relay's wake-up subscription
-- (on a connection of its own; {channel} is the quoted channel).

-- name: enqueue
-- One statement for psycopg and SQLAlchemy callers: the row and, only if it was inserted and
-- the statement is rendered with the notify fragment below, a NOTIFY that PostgreSQL delivers
-- at commit (and drops on rollback). Rendered without it for Outbox(notify=False), and with the
-- watch fragments for the enqueues a debounced outbox (Outbox(notify_interval_ms=…)) sends
-- within an interval of the last NOTIFY. It returns the transaction's id (xid8, as text), which
-- the Outbox keeps for the enqueues that follow a NOTIFY it carried.
--
-- The watch fragments (debounced): the NOTIFYs already sent in this interval (by the enqueues in
-- "watch", "<transaction id>:<row id>" joined by commas) cover this row once one of them
-- committed, since the relay woken by it looks again every interval for a second. A NOTIFY is
-- sent with its row in one statement, so it was delivered only if its row was: a savepoint
-- rolled back after it discards both while the transaction goes on. So a NOTIFY covers only if
-- its row is seen (by primary key), or, for a committed transaction this snapshot cannot see
-- (REPEATABLE READ), is assumed to; an own transaction's NOTIFY covers only with its row. While none has committed this enqueue
-- notifies too if "may_cover" (the Outbox allows one such covering NOTIFY per interval, so that a
-- long transaction does not hold back the rows committed beside it, and concurrent writers do not
-- all notify); if every one rolled back (or its status is gone) it notifies in any case. Within
-- a watched transaction itself it never does. An id at or beyond the snapshot's xmax has not
-- completed (it is running: pg_xact_status would raise for it, as "in the future"). The
-- statement then also returns own, committed, open and the NOTIFY's void (NULL if not sent).
--
-- job_id (v2) = "sd2-" + SHA-256 hex of "<namespace byte length>:<namespace><key>" (the length
-- prefix keeps distinct (namespace, key) pairs apart); only [a-z0-9-], so Node-safe (no ':', not
-- all digits). v1 ("sd-" + sha256(key), 0.1.0) stays on the rows written with it: the relay
-- publishes the stored id. Without a namespace, the outbox's identity is the namespace: the
-- database, the table's real schema (resolved through search_path when the Outbox has none) and
-- the table, each quote_ident()-ed so the joined text is unambiguous. The namespace is stored
-- beside the id (job_namespace), so that the relay can check the id against the key.
--
-- trace_context: the W3C trace context of the enqueuing span (sdcore.tracing), or NULL; not part
-- of the message (nor of its digest): the same message enqueued from two traces is one message.
--
-- message_digest: computed by the caller (sdcore.outbox._model.message_digest), the SHA-256 of a
-- canonical JSON of [queue, name, payload, options] with keys sorted and numbers written by value,
-- so that messages jsonb's "=" calls equal (10 and 10.0 included) have equal digests. Rows an
-- older sdcore wrote may hold the SHA-256 of jsonb's text instead (see existing).
WITH inserted AS (
    INSERT INTO {table} (idempotency_key, queue, name, job_id, payload, options, max_attempts,
                         message_digest, trace_context, job_namespace)
    SELECT m.key, m.queue, m.name,
           'sd2-' || encode(sha256(convert_to(
               CAST(octet_length(convert_to(m.ns, 'UTF8')) AS text) || ':' || m.ns || m.key,
               'UTF8')), 'hex'),
           m.payload, m.options, m.max_attempts, m.digest, m.trace_context, m.ns
    FROM (
        SELECT CAST(%(key)s AS text) AS key, CAST(%(queue)s AS text) AS queue,
               CAST(%(name)s AS text) AS name, CAST(%(payload)s AS jsonb) AS payload,
               CAST(%(options)s AS jsonb) AS options, CAST(%(max)s AS integer) AS max_attempts,
               CAST(%(trace)s AS jsonb) AS trace_context, CAST(%(digest)s AS bytea) AS digest,
               COALESCE(CAST(%(namespace)s AS text), (
                   SELECT quote_ident(current_database()) || '.' || quote_ident(n.nspname)
                          || '.' || quote_ident(c.relname)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE c.oid = CAST(%(target)s AS regclass))) AS ns
    ) AS m
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id, job_id
)
SELECT id, job_id, CAST(pg_current_xact_id() AS text){notify} FROM inserted{watch}

-- name: notify
, pg_notify(CAST(%(channel)s AS text), '')

-- name: notify_unless_committed
, w.own, w.committed, w.open,
  CASE WHEN w.own OR w.committed OR (w.open AND NOT CAST(%(may_cover)s AS boolean)) THEN NULL
       ELSE pg_notify(CAST(%(channel)s AS text), '') END

-- name: watch
, (SELECT coalesce(bool_or(x = pg_current_xact_id() AND seen), false) AS own,
          coalesce(bool_or(s = 'committed'
                           AND (seen OR NOT pg_visible_in_snapshot(x, pg_current_snapshot()))),
                   false) AS committed,
          coalesce(bool_or(s = 'in progress' AND x <> pg_current_xact_id()), false) AS open
   FROM (SELECT x, CASE WHEN x < pg_snapshot_xmax(pg_current_snapshot())
                        THEN pg_xact_status(x) ELSE 'in progress' END AS s,
                EXISTS (SELECT 1 FROM {table} AS r WHERE r.id = w_id) AS seen
         FROM (SELECT CAST(split_part(p, ':', 1) AS xid8) AS x,
                      CAST(split_part(p, ':', 2) AS bigint) AS w_id
               FROM unnest(string_to_array(CAST(%(watch)s AS text), ',')) AS p) AS pairs) AS v
  ) AS w

-- name: existing
-- After ON CONFLICT DO NOTHING: is the existing row (or tombstone) the same message? A separate
-- statement, so under READ COMMITTED it sees a row another transaction committed meanwhile. A
-- live row is compared with jsonb's "=" (10 = 10.0, key order ignored), whatever digest it holds;
-- a tombstone (payload dropped) by its digest: the canonical one, or for a tombstone an older
-- sdcore wrote the SHA-256 of jsonb's text (there numbers must be written alike: 10 is not 10.0).
SELECT CASE WHEN pruned_at IS NULL
            THEN queue = CAST(%(queue)s AS text) AND name = CAST(%(name)s AS text)
                 AND payload = CAST(%(payload)s AS jsonb) AND options = CAST(%(options)s AS jsonb)
            ELSE message_digest = CAST(%(digest)s AS bytea)
                 OR message_digest = sha256(convert_to(CAST(jsonb_build_array(
                        CAST(%(queue)s AS text), CAST(%(name)s AS text),
                        CAST(%(payload)s AS jsonb), CAST(%(options)s AS jsonb)) AS text), 'UTF8'))
       END,
       queue, name, status, pruned_at IS NOT NULL
FROM {table} WHERE idempotency_key = CAST(%(key)s AS text)

-- name: claim
-- Claim due rows for claim_ms: a short autocommit statement, no transaction held across Redis
-- I/O. SKIP LOCKED and the claim time keep concurrent relays off each other's rows; a relay
-- that dies leaves its claims to expire. No "id > cursor": a row that commits late is still due.
-- The claim token fences the outcome: a relay whose claim was taken over cannot record one.
-- The ids are picked once (ARRAY(…) is an InitPlan) and the rows then found by primary key: as
-- "id IN (SELECT …)" PostgreSQL 15 may hash-join the picked ids against a sequential scan of
-- the whole table, published history included (a cost growing with the table), and a
-- semi-join may even run a SKIP LOCKED subquery more than once. The JSON columns come
-- back as text: the store decodes them itself, and a batch's equal options once.
--
-- A claim holds at most max_bytes of payload (payload_bytes, summed in claim order) besides at
-- most limit rows, and always at least one row: a relay's memory follows the bytes it holds,
-- and a Redis pipeline must be written within the socket timeout. A due row whose last claim
-- expired with no outcome (claimed_until still set: every outcome clears it) may be a message
-- that kills its relay, so it is claimed alone (claimed_alone), and a batch stops before it: a
-- poison takes no neighbour down twice. Once such a claim of its own expired too and its
-- attempts are spent, it is marked DEAD here, since the relay that would record its failure
-- never does (a row lost in a batch thus gets one claim more than max_attempts at most).
-- Those DEAD rows are picked and updated but not returned. Parameters: limit, max_bytes,
-- claim_ms, token.
WITH picked AS MATERIALIZED (
    SELECT id, spent FROM (
        SELECT id, spent,
               row_number() OVER w AS n,
               bool_or(lost) OVER w AS lost_so_far,
               sum(payload_bytes) OVER w AS bytes_so_far
        FROM (
            SELECT id, next_attempt_at, payload_bytes,
                   claimed_until IS NOT NULL AS lost,
                   claimed_until IS NOT NULL AND claimed_alone AND attempts >= max_attempts
                       AS spent
            FROM {table}
            WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()
              AND (claimed_until IS NULL OR claimed_until < clock_timestamp())
            ORDER BY next_attempt_at, id
            LIMIT %s
            FOR UPDATE SKIP LOCKED
        ) AS due
        WINDOW w AS (PARTITION BY spent ORDER BY next_attempt_at, id)
    ) AS ranked
    WHERE spent OR n = 1 OR (NOT lost_so_far AND bytes_so_far <= %s)
),
buried AS (
    UPDATE {table}
    SET status = 'DEAD', claimed_until = NULL, claim_token = NULL,
        lost_claims = lost_claims + 1,
        last_error = 'claimed ' || attempts || ' times, ' || (lost_claims + 1)
                     || ' of them with no outcome: the relay died (or lost its database)'
                     || ' while publishing it; its job may already be in the broker'
    WHERE id = ANY(ARRAY(SELECT id FROM picked WHERE spent))
)
UPDATE {table}
SET claimed_until = clock_timestamp() + %s * interval '1 millisecond', claim_token = %s,
    attempts = attempts + 1,
    lost_claims = lost_claims + CASE WHEN claimed_until IS NULL THEN 0 ELSE 1 END,
    claimed_alone = claimed_until IS NOT NULL
WHERE id = ANY(ARRAY(SELECT id FROM picked WHERE NOT spent))
RETURNING id, idempotency_key, queue, name, job_id, payload::text, options::text, attempts,
          max_attempts, created_at, trace_context::text, job_namespace

-- name: published
-- A delivery is a fact, whoever's claim it was: any relay that published the job may mark the
-- row, even one whose claim was taken over, and even a row another relay marked DEAD meanwhile
-- (the job is in the broker, so it is not dead). One statement per batch. Parameter: the ids.
UPDATE {table} SET status = 'PUBLISHED', published_at = clock_timestamp(), claimed_until = NULL,
                   claim_token = NULL, last_error = NULL
WHERE id = ANY(%b) AND status IN ('PENDING', 'DEAD')

-- name: failed
-- A message's own failure: back off (delay per row), dead after max_attempts. Only under the
-- claim that made the attempt: if another relay took the row over (and may have delivered it),
-- this relay's failure is not the row's outcome. Parameters: ids, errors, delays, token.
UPDATE {table} AS o
SET claimed_until = NULL,
    claim_token = NULL,
    last_error = f.error,
    next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    status = CASE WHEN o.attempts >= o.max_attempts THEN 'DEAD' ELSE 'PENDING' END
FROM unnest(%b::bigint[], %b::text[], %b::bigint[]) AS f(id, error, delay_ms)
WHERE o.id = f.id AND o.status = 'PENDING' AND o.claim_token = %s
RETURNING o.id, o.status

-- name: unclaim
-- The broker was down (or the relay stopped before publishing a claimed batch): not the
-- message's fault, so the attempt does not count. Parameters: error, ids, token.
UPDATE {table} SET claimed_until = NULL, claim_token = NULL, attempts = greatest(attempts - 1, 0),
                   last_error = %s
WHERE id = ANY(%b) AND status = 'PENDING' AND claim_token = %s

-- name: extend
-- A relay still publishing a batch keeps its claim: a publish that outlasts claim_ms (a Redis
-- that stalls until the socket timeout) is not a relay that died, and another relay taking the
-- rows over would count the claim as lost (and, attempts spent, mark the rows DEAD) for an
-- outage. Only under the claim's own token. Parameters: claim_ms, ids, token.
UPDATE {table} SET claimed_until = clock_timestamp() + %s * interval '1 millisecond'
WHERE id = ANY(%b) AND status = 'PENDING' AND claim_token = %s

-- name: identity
-- The outbox's default namespace, as enqueue computes it (database, real schema and table,
-- each quote_ident()-ed). Parameter: the table's (quoted, maybe qualified) name.
SELECT quote_ident(current_database()) || '.' || quote_ident(n.nspname) || '.'
       || quote_ident(c.relname)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = CAST(%s AS regclass)

-- name: shared_job_ids
-- Of these rows, the ones whose job id another row holds too (BullMQ would keep one of the two
-- messages and drop the other as its duplicate). Asked only for rows whose sd2- id cannot be
-- checked against a stored namespace and is not the id of their key under the namespaces the
-- relay knows: a hash join, one pass over the table. Parameter: the ids.
SELECT DISTINCT s.id FROM {table} AS s JOIN {table} AS o ON o.job_id = s.job_id AND o.id <> s.id
WHERE s.id = ANY(%b)

-- name: tombstone
-- Pruning, step 1: published rows past the retention become tombstones (payload and options
-- dropped; key, digest and job id kept), so the key stays taken for the deduplication window.
-- Parameters: older_than_ms, limit. (ids picked once, rows found by primary key, as in claim.)
UPDATE {table} SET payload = jsonb_build_object(), options = jsonb_build_object(),
                   pruned_at = clock_timestamp()
WHERE id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE status = 'PUBLISHED' AND pruned_at IS NULL
      AND published_at < clock_timestamp() - %s * interval '1 millisecond'
    LIMIT %s
))

-- name: prune
-- Step 2: tombstones of messages published before the window are deleted: only then can the
-- key be enqueued again (as a new message). Parameters: older_than_ms, limit.
DELETE FROM {table} WHERE id = ANY(ARRAY(
    SELECT id FROM {table}
    WHERE pruned_at IS NOT NULL
      AND published_at < clock_timestamp() - %s * interval '1 millisecond'
    LIMIT %s
))

-- name: stats
SELECT count(*) FILTER (WHERE status = 'PENDING'),
       count(*) FILTER (WHERE status = 'PENDING' AND next_attempt_at <= clock_timestamp()),
       count(*) FILTER (WHERE status = 'DEAD'),
       count(*) FILTER (WHERE status = 'PUBLISHED' AND pruned_at IS NULL),
       extract(epoch FROM clock_timestamp() - min(created_at) FILTER (WHERE status = 'PENDING')),
       count(*) FILTER (WHERE pruned_at IS NOT NULL)
FROM {table}

-- name: retry
-- An operator's retry (sdcore outbox retry): a DEAD or PENDING row is due now, attempts reset.
-- Parameter: the id.
UPDATE {table} SET status = 'PENDING', attempts = 0, lost_claims = 0,
                   next_attempt_at = clock_timestamp(), claimed_until = NULL, claim_token = NULL
WHERE id = %s AND status IN ('DEAD', 'PENDING')
RETURNING id

-- name: list_rows
-- An operator's listing (sdcore outbox list, the dashboard's outbox page; the relay's start-up
-- check with no status and limit 0): rows of these statuses, newest first, on the primary key.
-- Parameters: the statuses (text[]), the limit.
SELECT id, status, queue, name, attempts, max_attempts, next_attempt_at, idempotency_key, job_id,
       last_error, created_at, published_at, claimed_until
FROM {table} WHERE status = ANY(%b::text[]) ORDER BY id DESC LIMIT %s

-- name: listen
LISTEN {channel}
