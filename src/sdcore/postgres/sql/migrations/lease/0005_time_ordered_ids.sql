-- Time-ordered ids. New rows get a UUID version 7 (RFC 9562): the first 48
-- bits are the database clock's Unix time in milliseconds, the version nibble is 7, the rest is
-- gen_random_uuid()'s randomness (74 random bits: collisions stay as unlikely as before; the
-- primary key still rejects one). With gen_random_uuid() every insert wrote its primary-key entry
-- on a random leaf page: after each checkpoint, a full-page image of that page in the WAL (~8 KB),
-- and random page splits. Ids drawn in time order all land on the rightmost leaf pages, which
-- stay in memory and are logged in full once per checkpoint.
--
-- Existing rows keep their ids (no table rewrite, no lock beyond the brief ALTER). The id stays
-- an opaque uuid to every reader: nothing orders or parses it. PostgreSQL 15 has no uuidv7(),
-- hence the expression (a few microseconds of server CPU per insert). Idempotent.
ALTER TABLE {table}
    ALTER COLUMN id SET DEFAULT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid;
