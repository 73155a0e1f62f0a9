-- Outbox: the namespace a row's v2 job id was derived from ("sd2-" + SHA-256 of the
-- namespace's length, the namespace and the key), so that the relay can check that a row's job
-- id is its own key's and not another message's (a row written by hand with another key's id
-- would make BullMQ drop one of the two as a duplicate). NULL on rows written before, and on rows
-- with a 0.1.0 "sd-" id (derived from the key alone).
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS job_namespace text;
