"""sdcore schedules migration 0003_sync_definitions, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("schedules", 3, after="0014_schedules_action_requests")
