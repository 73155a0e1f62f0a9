"""sdcore lease migration 0007_lease_marks, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 7, after="0006_lease_running_idx")
