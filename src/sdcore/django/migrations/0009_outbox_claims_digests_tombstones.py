"""sdcore outbox migration 0002_claims_digests_tombstones, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("outbox", 2, after="0008_outbox_initial")
