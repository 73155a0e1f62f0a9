"""sdcore lease migration 0002_owner, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 2, after="0001_lease_initial")
