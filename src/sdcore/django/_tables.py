"""The names of sdcore's tables as Django's models and migrations spell them (``db_table``)."""

from __future__ import annotations

from sdcore.postgres import DEFAULT_TABLES, Component, derived_name

__all__ = ["db_table"]


def db_table(component: Component, companion: str | None = None) -> str:
    """Return a ``db_table`` of sdcore's: ``"outbox"``, or ``'"schema"."outbox"'`` with
    ``SDCORE["SCHEMA"]``.

    Django's PostgreSQL backend quotes a name unless it is already quoted, so the
    schema-qualified form reaches SQL as written. The migration and the models call this with
    the same settings, so ``makemigrations`` sees no change.

    Args:
        component: ``"lease"``, ``"outbox"`` or ``"schedules"`` (its default table).
        companion: A companion table of the schedules table (``"runs"``, ``"actions"``).
    """
    from sdcore.django._settings import SdcoreSettings

    table = DEFAULT_TABLES[component]
    if companion is not None:
        table = derived_name(table, companion)
    schema = SdcoreSettings.from_django().schema
    return table if schema is None else f'"{schema}"."{table}"'
