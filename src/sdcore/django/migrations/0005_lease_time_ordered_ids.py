"""sdcore lease migration 0005_time_ordered_ids, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 5, after="0004_lease_hot_updates")
