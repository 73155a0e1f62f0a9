"""sdcore lease migration 0001_initial, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("lease", 1, after=None)
