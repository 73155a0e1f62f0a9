"""sdcore outbox migration 0003_trace_context, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("outbox", 3, after="0009_outbox_claims_digests_tombstones")
