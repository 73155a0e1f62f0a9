"""sdcore lease migration 0006_running_idx, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 6, after="0005_lease_time_ordered_ids")
