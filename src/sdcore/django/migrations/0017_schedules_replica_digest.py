"""sdcore schedules migration 0005_replica_digest, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("schedules", 5, after="0016_schedules_runs_running_idx")
