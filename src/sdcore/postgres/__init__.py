"""PostgreSQL plumbing shared by every sdcore feature: schema, DSN handling, held connections."""

from sdcore.postgres._dsn import redact_dsn, redact_text
from sdcore.postgres._schema import (
    SCHEMA_LOCK_ID,
    InvalidIdentifierError,
    apply_schema,
    check_identifier,
    derived_name,
    outbox_schema_sql,
    schema_sql,
)

__all__ = [
    "SCHEMA_LOCK_ID",
    "InvalidIdentifierError",
    "apply_schema",
    "check_identifier",
    "derived_name",
    "outbox_schema_sql",
    "redact_dsn",
    "redact_text",
    "schema_sql",
]
