"""PostgreSQL plumbing shared by every sdcore feature: migrations, DSNs, pools, connections."""

from sdcore.postgres._connections import HeldConnections
from sdcore.postgres._dsn import redact_dsn, redact_text
from sdcore.postgres._migrations import (
    DEFAULT_TABLES,
    AppliedMigration,
    Component,
    Migration,
    MigrationError,
    MigrationScript,
    MigrationStatus,
    full_sql,
    migrate,
    migration_scripts,
    migration_status,
    migrations,
    outbox_schema_sql,
    schema_sql,
)
from sdcore.postgres._notify import notifications
from sdcore.postgres._pool import (
    DatabaseConnectError,
    PoolSettings,
    SdcorePool,
    create_pool,
    open_pool,
)
from sdcore.postgres._pooling import POOLER_SQLSTATES
from sdcore.postgres._schema import (
    SCHEMA_LOCK_ID,
    InvalidIdentifierError,
    apply_schema,
    check_identifier,
    derived_name,
)
from sdcore.postgres._upgrade import TableInventory, UpgradeReport, upgrade

__all__ = [
    "DEFAULT_TABLES",
    "POOLER_SQLSTATES",
    "SCHEMA_LOCK_ID",
    "AppliedMigration",
    "Component",
    "DatabaseConnectError",
    "HeldConnections",
    "InvalidIdentifierError",
    "Migration",
    "MigrationError",
    "MigrationScript",
    "MigrationStatus",
    "PoolSettings",
    "SdcorePool",
    "TableInventory",
    "UpgradeReport",
    "apply_schema",
    "check_identifier",
    "create_pool",
    "derived_name",
    "full_sql",
    "migrate",
    "migration_scripts",
    "migration_status",
    "migrations",
    "notifications",
    "open_pool",
    "outbox_schema_sql",
    "redact_dsn",
    "redact_text",
    "schema_sql",
    "upgrade",
]
