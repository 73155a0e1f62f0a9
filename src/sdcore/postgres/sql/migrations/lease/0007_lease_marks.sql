-- Lease state in columns of its own, and a fencing sequence that hands out tokens in order.
-- Idempotent: running it again (e.g. after `sdcore db sql` was applied by hand) changes nothing.
--
-- released, given_back: why a FAIL row may be taken again by a scheduled tick's acquire. They
-- were keys of the caller's `data` (released / released_by, given_back), so a handler's
-- fail(lease, {"given_back": …}) made its tick be retaken at once and {"released": …} started a
-- new attempt budget: a payload could re-run a tick. Only the lease's own statements write these
-- columns (the owner's release(), a give-back, an operator's or a backfill's release); every
-- takeover clears them, and `data` is never read as lease state again.
-- - released: who reopened the row ('owner', 'operator', 'restart', 'backfill:<id>'): the next
--   tick acquire takes it and starts a new attempt budget;
-- - given_back: why the acquire that won the row gave it back unstarted: the next tick acquire
--   takes it with the same attempt number.
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS released text,
    ADD COLUMN IF NOT EXISTS given_back text;

-- Rows written before this migration carry the marks in `data` (only lease statements wrote
-- those keys on FAIL rows then); a row already marked is left alone.
UPDATE {table}
SET released = coalesce(data ->> 'released_by', 'owner')
WHERE status = 'FAIL' AND released IS NULL AND given_back IS NULL
  AND (data ? 'released' OR data ? 'released_by');
UPDATE {table}
SET given_back = coalesce(data ->> 'given_back', 'given back')
WHERE status = 'FAIL' AND released IS NULL AND given_back IS NULL AND data ? 'given_back';

-- CACHE 1: every nextval() reads the one sequence, so tokens are handed out in the order they
-- are drawn across all sessions. With CACHE n each session pre-allocates a block of n values:
-- a key created anew (after a prune) by a session still drawing from an older block got a
-- token below the one its deleted row had, and a resource that saw the higher token refused the
-- new owner. A hand-tuned or pg_dump-restored cache is pinned back here; do not raise it again.
ALTER SEQUENCE {object:fencing_seq} CACHE 1;
