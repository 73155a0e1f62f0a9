"""sdcore schedules migration 0002_action_requests, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("schedules", 2, after="0013_schedules_initial")
