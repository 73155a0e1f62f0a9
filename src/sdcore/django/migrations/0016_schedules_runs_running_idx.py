"""sdcore schedules migration 0004_runs_running_idx, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("schedules", 4, after="0015_schedules_sync_definitions")
