"""PostgreSQL plumbing shared by every sdcore feature: migrations, DSNs, held connections."""

from sdcore.postgres._dsn import redact_dsn, redact_text
from sdcore.postgres._migrations import (
    AppliedMigration,
    Migration,
    MigrationError,
    MigrationStatus,
    full_sql,
    migrate,
    migration_scripts,
    migration_status,
    migrations,
    outbox_schema_sql,
    schema_sql,
)
from sdcore.postgres._schema import (
    SCHEMA_LOCK_ID,
    InvalidIdentifierError,
    apply_schema,
    check_identifier,
    derived_name,
)

__all__ = [
    "SCHEMA_LOCK_ID",
    "AppliedMigration",
    "InvalidIdentifierError",
    "Migration",
    "MigrationError",
    "MigrationStatus",
    "apply_schema",
    "check_identifier",
    "derived_name",
    "full_sql",
    "migrate",
    "migration_scripts",
    "migration_status",
    "migrations",
    "outbox_schema_sql",
    "redact_dsn",
    "redact_text",
    "schema_sql",
]
