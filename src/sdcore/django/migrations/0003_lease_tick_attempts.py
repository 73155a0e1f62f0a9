"""sdcore lease migration 0003_tick_attempts, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 3, after="0002_lease_owner")
