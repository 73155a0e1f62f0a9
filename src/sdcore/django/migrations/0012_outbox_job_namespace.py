"""sdcore outbox migration 0005_job_namespace, applied by sdcore's runner."""

from sdcore.django._migrations import sdcore_migration

Migration = sdcore_migration("outbox", 5, after="0011_outbox_claim_bytes_lost_claims")
