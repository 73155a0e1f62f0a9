"""sdcore outbox migration 0004_claim_bytes_lost_claims, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("outbox", 4, after="0010_outbox_trace_context")
