-- Each replica's digest of the schedule names it declares, written with its membership read:
-- replicas with equal digests declare the same schedules, so a replica reads the declarations
-- only of a digest it has not seen (the owners of each exclusive schedule are chosen among the
-- live replicas that declare it). Idempotent.
ALTER TABLE {object:replicas} ADD COLUMN IF NOT EXISTS schedules_digest text;
CREATE INDEX IF NOT EXISTS {name:replicas_digest_idx} ON {object:replicas} (schedules_digest);
