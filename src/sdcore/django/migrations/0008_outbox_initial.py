"""sdcore outbox migration 0001_initial, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("outbox", 1, after="0007_lease_lease_marks")
