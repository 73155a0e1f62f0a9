"""sdcore schedules migration 0001_initial, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("schedules", 1, after="0012_outbox_job_namespace")
