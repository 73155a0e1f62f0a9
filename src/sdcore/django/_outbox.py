"""``enqueue_once`` on Django's own connection, in the caller's ``transaction.atomic()``.

The message goes through :meth:`sdcore.sync.Outbox.enqueue_via`: the outbox's own statements
(the same SQL, idempotency rules and ``NOTIFY`` debounce as every other enqueue path), run on
Django's cursor, so the row commits or rolls back with the caller's transaction and shows in
Django's query log. The relay is woken by the ``NOTIFY`` that statement carries: PostgreSQL
delivers it when the outermost transaction commits and drops it on a rollback (of the whole
transaction, or of the savepoint of an inner ``atomic()`` around the enqueue).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from django.db import connections
from django.db.transaction import TransactionManagementError

from sdcore.outbox import OutboxTransactionRequiredError

__all__ = ["AtomicBlockRequiredError", "enqueue_once"]


class AtomicBlockRequiredError(OutboxTransactionRequiredError, TransactionManagementError):  # type: ignore[misc]
    """``sdcore.django.enqueue_once`` was called outside ``transaction.atomic()``.

    Both the outbox's :class:`~sdcore.outbox.OutboxTransactionRequiredError` and Django's
    ``TransactionManagementError`` (what Django raises for ``select_for_update`` outside a
    transaction). Nothing was written.

    Attributes:
        connection_type: ``"Django connection 'ALIAS'"``.
    """

    def __init__(self, alias: str) -> None:
        self.connection_type = f"Django connection {alias!r}"
        Exception.__init__(
            self,
            f"sdcore.django.enqueue_once needs a transaction: Django connection {alias!r} is not"
            " inside transaction.atomic(), so the message would commit at once, before (and"
            " without) the change it belongs to. Wrap the change and the enqueue in"
            f" `with transaction.atomic(using={alias!r}):`",
        )


class _DjangoConnection:
    """The :class:`sdcore.sync.OutboxDriver` of one Django connection (an alias)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.connection = connections[alias]

    def begin(self) -> Hashable:
        connection = self.connection
        if not connection.in_atomic_block:
            raise AtomicBlockRequiredError(self.alias)
        # Django's own refusal while an error inside the block awaits its rollback.
        connection.validate_no_broken_transaction()
        connection.ensure_connection()
        info = connection.connection.info
        # The key of the psycopg path for the same server: one debounce per database.
        return (info.host, info.port, info.dbname)

    def first(self, statement: str, params: Mapping[str, Any]) -> Sequence[Any] | None:
        with self.connection.cursor() as cursor:
            cursor.execute(statement, params)
            found = cursor.fetchone()
        return None if found is None else tuple(found)


def enqueue_once(
    *,
    idempotency_key: str,
    queue: str,
    name: str,
    payload: Mapping[str, Any],
    options: Mapping[str, Any] | None = None,
    using: str | None = None,
) -> bool:
    """Write one outbox message in the caller's ``transaction.atomic()``; the same again is a no-op.

    The rules of :meth:`sdcore.outbox.Outbox.enqueue_once`, on Django's connection: everything
    is validated before any SQL (a bad message never breaks the caller's transaction); the row
    commits or rolls back with the caller's transaction (an inner ``atomic()`` rolled back takes
    it with it); the same message under the same key returns ``False``, another message under it
    raises. When the outermost block commits, PostgreSQL delivers the ``NOTIFY`` that wakes
    the relay of ``manage.py sdcore run``; a rollback wakes nothing. The outbox is the one of
    :func:`~sdcore.django.get_runtime` (its table in ``SDCORE["SCHEMA"]``), the relay's.

    Args:
        idempotency_key: Unique per message, e.g. ``f"task-{task.pk}-done"``.
        queue: BullMQ queue name (``[A-Za-z0-9_.-]``, 1–100).
        name: BullMQ job name.
        payload: The job's data, a JSON object.
        options: BullMQ job options (see :func:`sdcore.outbox.check_options`).
        using: The ``DATABASES`` alias whose transaction the row joins (default
            ``SDCORE["DATABASE"]``). The relay reads the outbox of ``SDCORE["DATABASE"]``, so
            another alias must reach the same database.

    Returns:
        ``True`` if the row was inserted, ``False`` if this key already holds the same message.

    Raises:
        AtomicBlockRequiredError: Not inside ``transaction.atomic(using=…)``; nothing written.
        InvalidOutboxMessageError: A bad key, queue, name or option.
        JsonTypeError: ``payload`` is not JSON.
        JsonValueError: ``payload`` cannot be stored in jsonb.
        OutboxKeyConflictError: The key holds a different message (nothing was written).
        django.core.exceptions.ImproperlyConfigured: ``using`` is not in ``DATABASES``, not
            PostgreSQL, or on psycopg 2.
        django.db.DatabaseError: The database refused a statement (Django's wrapper of the
            driver's error; a missing table: run ``manage.py migrate``).
    """
    from django.conf import settings

    from sdcore.django._runtime import get_runtime
    from sdcore.django._settings import SdcoreSettings, check_database
    from sdcore.sync import Outbox

    if using is None:
        alias = SdcoreSettings.from_django().database
    elif isinstance(using, str):
        alias = using
        check_database(alias, settings.DATABASES)
    else:
        raise TypeError(f"using must be a DATABASES alias (a str), got {type(using).__name__}")
    return Outbox.of(get_runtime().outbox).enqueue_via(
        _DjangoConnection(alias),
        idempotency_key=idempotency_key,
        queue=queue,
        name=name,
        payload=payload,
        options=options,
    )
