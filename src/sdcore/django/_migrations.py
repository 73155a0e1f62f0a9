"""Django migrations that apply sdcore's versioned migrations through sdcore's own runner.

One Django migration per sdcore migration step (lease, then outbox, then schedules, in version
order), so ``showmigrations`` lists them and ``sqlmigrate`` prints each step's SQL. Applying a
step runs :func:`sdcore.postgres.migrate` (``through=`` the step's version) on a connection of
its own to the same database: under sdcore's schema advisory lock, after reading
``sdcore_migrations``, so a step ``sdcore db upgrade`` already applied is a no-op, and two pods
migrating at once apply each step once. Steps cannot be unapplied (sdcore ships no down
migrations): ``migrate sdcore zero`` stops with Django's ``IrreversibleError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from django.db import migrations, router
from django.db.migrations.operations.base import Operation

from sdcore.postgres import DEFAULT_TABLES, Component, migrate, migration_scripts

__all__ = ["ApplySdcoreMigration", "sdcore_migration"]


class ApplySdcoreMigration(Operation):  # type: ignore[misc]
    """Apply one sdcore migration (and any earlier one still pending) to its table."""

    reversible = False
    reduces_to_sql = True

    def __init__(self, component: Component, version: int) -> None:
        self.component = component
        self.version = version

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (type(self).__qualname__, [], {"component": self.component, "version": self.version})

    def state_forwards(self, app_label: str, state: Any) -> None:
        """sdcore's tables are no Django models: the project state does not change."""

    def describe(self) -> str:
        return f"Apply sdcore {self.component} migration {self.version:04d}"

    @property
    def migration_name_fragment(self) -> str:
        return f"sdcore_{self.component}_{self.version:04d}"

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        connection = schema_editor.connection
        if not router.allow_migrate(connection.alias, app_label):
            return
        from sdcore.django._settings import SdcoreSettings, conninfo_of

        schema = SdcoreSettings.from_django().schema
        table = DEFAULT_TABLES[self.component]
        if schema_editor.collect_sql:  # sqlmigrate: the step's self-recording script
            script = migration_scripts(self.component, table=table, schema=schema)
            chosen = next(s for s in script if s.migration.version == self.version)
            schema_editor.execute(
                "-- applied by sdcore's runner under its schema advisory lock, and skipped "
                "when sdcore_migrations already records it\n" + chosen.sql.rstrip()
            )
            return
        dsn = conninfo_of(connection.get_connection_params())

        async def apply() -> None:
            import psycopg

            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await migrate(
                    conn, self.component, table=table, schema=schema, through=self.version
                )

        # On a thread of its own: ``migrate`` may be called from inside a running event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, apply()).result()

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        """Never called: the operation is not reversible."""
        raise NotImplementedError


def sdcore_migration(
    component: Component, version: int, *, after: str | None
) -> type[migrations.Migration]:
    """Return the Django ``Migration`` class of one sdcore migration step.

    Args:
        component: ``"lease"``, ``"outbox"`` or ``"schedules"``.
        version: The sdcore migration's version.
        after: The previous Django migration of this app, or ``None`` for the first.
    """

    class Migration(migrations.Migration):  # type: ignore[misc]
        dependencies = [] if after is None else [("sdcore", after)]
        operations = [ApplySdcoreMigration(component, version)]  # noqa: RUF012

    return Migration
