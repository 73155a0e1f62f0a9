-- Outbox: claims bounded in bytes, and claims lost with their relay counted.
-- payload_bytes is the payload's size as jsonb text (what the claim returns), kept by PostgreSQL
-- itself (a stored generated column: no writer computes it, and a tombstone's shrinks with its
-- payload), so that the claim can stop at a byte budget without reading a single payload.
-- Adding it rewrites the table once, under an ACCESS EXCLUSIVE lock.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS payload_bytes integer
    GENERATED ALWAYS AS (octet_length(payload::text)) STORED;
-- lost_claims counts the claims of a row that expired with no outcome (its relay died, or lost
-- the database, while publishing it), and claimed_alone says whether its last claim was one of
-- its own: the claim isolates a row whose claim was lost, and marks it DEAD once a claim of its
-- own was lost too and its attempts are spent, with the count in last_error.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS lost_claims integer NOT NULL DEFAULT 0;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS claimed_alone boolean NOT NULL DEFAULT false;
