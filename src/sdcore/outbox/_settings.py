"""``RelaySettings``: how a :class:`~sdcore.Runtime` runs its outbox relay, as one value."""

from __future__ import annotations

from dataclasses import dataclass

from sdcore._internal.validation import at_least, int_between, positive_number, text
from sdcore.outbox._relay import DEFAULT_RELAY_BATCH_BYTES, DEFAULT_RELAY_BATCH_SIZE, MAX_CLAIM_ROWS

__all__ = ["RelaySettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RelaySettings:
    """The outbox relay a :class:`~sdcore.Runtime` runs when it has a ``redis_url``.

    ``Runtime(relay=RelaySettings(...))`` turns it on with these values (the default);
    ``Runtime(relay=None)`` runs no relay in this process (the rows wait in PostgreSQL for a
    replica that relays them).

    Attributes:
        batch_size: Outbox rows claimed at a time.
        batch_bytes: Payload bytes claimed at a time (the relay's memory follows it).
        listen_url: A direct (not pooled) URL of the same database for the relay's LISTEN.
            Under ``PoolSettings(transaction_pooling=True)`` without it the relay polls (a
            notification cannot cross a transaction-mode pooler); with it, it is woken within
            milliseconds. ``None``: LISTEN on the pool's own database URL (or poll, as said).
        stuck_after_s: Readiness fails when the relay has rows due and completed no round for
            this long (see :mod:`sdcore.probes`).

    Raises:
        ValueError: A value out of range (the message names the field and the value).
        TypeError: ``listen_url`` not a str.
    """

    batch_size: int = DEFAULT_RELAY_BATCH_SIZE
    batch_bytes: int = DEFAULT_RELAY_BATCH_BYTES
    listen_url: str | None = None
    stuck_after_s: float = 60.0

    def __post_init__(self) -> None:
        int_between("batch_size", self.batch_size, 1, MAX_CLAIM_ROWS)
        at_least("batch_bytes", self.batch_bytes, 1)
        if self.listen_url is not None:
            text("listen_url", self.listen_url)
        positive_number("stuck_after_s", self.stuck_after_s)
