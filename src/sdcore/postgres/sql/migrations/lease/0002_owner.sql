-- Expiry is the owner's, and fencing tokens never restart. Idempotent: running it
-- again (e.g. after `sdcore db sql` was applied by hand) changes nothing.
--
-- lease_ms: the lease the current owner asked for, written by every acquire. A contender may
-- take a RUNNING row over only once modified_at + lease_ms has passed by the database clock,
-- whatever lease it asks for itself. Rows written by 0.1.0 keep NULL (the contender's lease
-- decides, as in 0.1.0) until their next acquire.
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS lease_ms bigint
        CONSTRAINT {name:lease_ms_check} CHECK (lease_ms IS NULL OR lease_ms > 2);

-- Fencing tokens come from one sequence per table: every insert and every takeover draws the
-- next value, so a key created anew (after a prune, or after a failover that lost its row) gets a
-- token above every token the table has handed out and the database has kept. The sequence is
-- moved above the largest token of the existing rows, never back. The lease statements call
-- nextval() themselves; the column keeps its 0.1.0 default.
CREATE SEQUENCE IF NOT EXISTS {object:fencing_seq} AS bigint MINVALUE 1;
ALTER SEQUENCE {object:fencing_seq} OWNED BY {table}.fencing_token;
SELECT setval($sdcore${object:fencing_seq}$sdcore$, existing.top, true)
FROM (SELECT max(fencing_token) AS top FROM {table}) AS existing,
     (SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END AS used
      FROM {object:fencing_seq}) AS seq
WHERE existing.top > seq.used;
