-- Scheduler attempt budgets: how many runs a scheduled tick has started across the
-- cluster. Rows written by 0.1.0 were acquired at least once: they take the default 1. A tick
-- recorded as skipped (overlap) has 0. Only sdcore.scheduling's tick acquire reads or writes it;
-- the plain lease API ignores it (a FAIL row stays takeable there, as in 0.1.0).
ALTER TABLE {table}
    ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 1
        CONSTRAINT {name:attempts_check} CHECK (attempts >= 0);
