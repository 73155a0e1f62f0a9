-- What a schedule's firing depends on, recorded in full. day_rule: how a cron expression's day
-- fields combine ('vixie' or 'nestjs'); before it, `list` and backfill evaluated every recorded
-- expression by the Vixie rule. definition: the definition each replica declares (kind,
-- expression, time_zone, day_rule, options), so that `sdcore schedules list` shows every live
-- version of a schedule during a rolling deploy, not only the one synced last. Idempotent.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS day_rule text NOT NULL DEFAULT 'vixie';
ALTER TABLE {object:declarations} ADD COLUMN IF NOT EXISTS definition jsonb;
