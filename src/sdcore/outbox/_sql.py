"""The outbox statements, read once from ``sdcore/postgres/sql/outbox.sql``.

The write path's statements use psycopg's named placeholders (``%(key)s``), as bytes for psycopg
and as text for the drivers of :meth:`~sdcore.outbox.Outbox.enqueue_via` (``sdcore.sqlalchemy``
turns them into its own binds, which its psycopg dialect compiles back to the same text).
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from sdcore._internal.sql import queries


@dataclass(frozen=True, slots=True)
class OutboxStatements:
    """Every statement rendered once for one table (bytes for psycopg, str for drivers)."""

    enqueue: bytes
    enqueue_text: str
    enqueue_quiet: bytes
    enqueue_quiet_text: str
    enqueue_watch: bytes
    enqueue_watch_text: str
    existing: bytes
    existing_text: str
    claim: bytes
    published: bytes
    failed: bytes
    unclaim: bytes
    extend: bytes
    identity: bytes
    shared_job_ids: bytes
    tombstone: bytes
    prune: bytes
    stats: bytes
    retry: bytes
    list_rows: bytes

    @classmethod
    def render(cls, table: sql.Identifier) -> OutboxStatements:
        """Render every statement of ``outbox.sql`` for ``table``."""
        found = queries("outbox")
        quoted = table.as_string(None)

        def one(name: str, notify: str = "", watch: str = "") -> str:
            # The fragments name the table too (the watch looks up the notifiers' rows).
            return (
                found[name]
                .replace("{notify}", notify)
                .replace("{watch}", watch)
                .replace("{table}", quoted)
            )

        enqueue = one("enqueue", found["notify"].strip())
        quiet = one("enqueue")
        watch = one(
            "enqueue",
            found["notify_unless_committed"].strip(),
            "\n" + found["watch"].strip(),
        )
        return cls(
            enqueue=enqueue.encode(),
            enqueue_text=enqueue,
            enqueue_quiet=quiet.encode(),
            enqueue_quiet_text=quiet,
            enqueue_watch=watch.encode(),
            enqueue_watch_text=watch,
            existing=one("existing").encode(),
            existing_text=one("existing"),
            claim=one("claim").encode(),
            published=one("published").encode(),
            failed=one("failed").encode(),
            unclaim=one("unclaim").encode(),
            extend=one("extend").encode(),
            identity=one("identity").encode(),
            shared_job_ids=one("shared_job_ids").encode(),
            tombstone=one("tombstone").encode(),
            prune=one("prune").encode(),
            stats=one("stats").encode(),
            retry=one("retry").encode(),
            list_rows=one("list_rows").encode(),
        )
