"""sdcore lease migration 0004_hot_updates, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 4, after="0003_lease_tick_attempts")
