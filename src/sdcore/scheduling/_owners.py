"""Owners: which live replicas ask for an exclusive schedule's ticks.

Without a view of the cluster every replica asks for every tick, and the lease picks one: the
database then answers one statement per replica per tick, so the fleet's cost grows with its
size. With the control plane on, each replica knows the live replicas (their heartbeats) and
which schedules each declares; an exclusive cron or interval schedule's tick is then asked for
by its **owners** only, the top :data:`OWNERS` replicas of a rendezvous hash of (the instant's
epoch, replica id) over the live replicas that declare the schedule (:meth:`Owners.fire_rank`;
an epoch is :data:`EPOCH_S` seconds):

- the first owner acquires at the instant;
- the second acquires :func:`second_delay` later (a quarter of the time to the schedule's next
  instant, at most 1 s), the third twice that; if an earlier owner started the tick, each costs
  one losing statement, and if the first is dead or cut off, the tick starts that much late;
- every other replica leaves the tick alone.

At a burst's instant, only its first owner walks its ticks. A later owner (by :meth:`Owners.place`,
the least of its ranks for the schedules it declares) looks at them at its turn, ranking them in
the order the view had at the instant (:meth:`Owners.order`); any other replica after the owners'
turns, only to re-arm them (:mod:`sdcore.scheduling._timer`).

Three, not two: a replica killed with ``kill -9`` stays in the others' view until its heartbeat
lapses, and an instant is lost only when every owner is such a replica. Under churn (a replica
killed or started every 2 s) two owners per instant lose ticks that three keep; see
``docs/benchmarks.md#fleet-owners-replicas-and-bursts-through-the-runtime``.

The ticks due at one instant share their owners, so each owner sends them as one batch statement and
records their outcomes and history together: the database's work per instant is that of one replica,
whatever the fleet's size (owners by schedule instead would spread one instant's ticks over most of
the fleet, each replica sending a statement of one or two keys). So do the instants of one epoch:
the same few replicas run a minute of per-second ticks on connections, prepared statements and
caches kept warm by the second before. Owners rotating every instant measured 2.06-2.22x the
server's CPU per tick at 24 replicas against 3 (a replica then ran the lease statements once in
eight seconds, on backends gone cold meanwhile), by the minute 0.94-1.54x
(``docs/benchmarks.md#fleet-owners-replicas-and-bursts-through-the-runtime``). Epochs rotate over
the replicas, which spreads the work over time; the ticks of one instant (a burst at 08:00) run on
one replica while it is live. The duties that are not a fire — start-up catch-up and the sweep — go
by schedule (:meth:`Owners.owns`: the top :data:`OWNERS` by a hash of (schedule, replica id)), so
they spread over the replicas too.

The lease still decides who runs a tick: replicas whose views of the cluster differ (one joined,
one's heartbeat lapsed) at worst both ask, an extra statement, never a double run. A replica
whose view is missing or stale asks for everything, as without a control plane. The hash moves a
schedule only when one of its owners leaves or joins, and spreads the schedules evenly.

What it costs: a first owner killed makes every tick of its epochs start :func:`second_delay`
late (the second owner's) until the others drop it from their view (:data:`MEMBER_TTL_BEATS`
heartbeats without one, then up to a heartbeat more to read it); when every owner of an epoch
dies at once, nobody asks for its ticks until then; the new owners then fire the next tick and
their catch-up sweep decides about the ticks in between, as for any missed tick.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = [
    "EPOCH_S",
    "LAST_ASK_S",
    "MEMBER_TTL_BEATS",
    "OWNERS",
    "Member",
    "Order",
    "Owners",
    "second_delay",
]

OWNERS = 3  # replicas that ask for each exclusive tick
# The instants of one epoch (whole multiples of this many seconds since the Unix epoch) share
# their owners.
EPOCH_S = 60.0
# A replica whose heartbeat is older than this many heartbeat intervals is no longer an owner.
MEMBER_TTL_BEATS = 3
_MAX_ORDERS = 64  # epochs whose order is kept
_MAX_SECOND_DELAY_S = 1.0
_MIN_SECOND_DELAY_S = 0.05
# The last owner of an instant asks at most this long after it (second_delay twice, at most).
LAST_ASK_S = (OWNERS - 1) * _MAX_SECOND_DELAY_S


def second_delay(gap: timedelta | None) -> float:
    """How long (seconds) the second owner waits before it asks for a tick (the third twice
    that): a quarter of ``gap``, the time from the tick's instant to the schedule's next one,
    between 50 ms and 1 s (1 s without a next instant)."""
    if gap is None:
        return _MAX_SECOND_DELAY_S
    return min(_MAX_SECOND_DELAY_S, max(_MIN_SECOND_DELAY_S, gap.total_seconds() / 4))


@dataclass(frozen=True, slots=True)
class Member:
    """A live replica as the control plane last read it.

    Attributes:
        replica_id: Its id.
        names: The schedules it declares; ``None``: whatever this replica declares when it
            ranks (the control plane names them: this replica's own declarations may change
            before the next read, the other's do not change with them).
    """

    replica_id: str
    names: frozenset[str] | None = None


# The live replicas in the rendezvous order of an epoch (``None``: this replica).
Order = tuple[Member | None, ...]


def _score(name: str, replica_id: str) -> bytes:
    return hashlib.blake2b(f"{name}\0{replica_id}".encode(), digest_size=8).digest()


class Owners:
    """This replica's view of the live replicas, and its rank among each schedule's owners.

    Args:
        replica_id: This replica.
        stale_s: A view not refreshed for this long is dropped (every replica asks again).
        clock: Monotonic seconds (inject one in tests).
    """

    def __init__(
        self,
        replica_id: str,
        *,
        stale_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica_id = replica_id
        self._stale_s = stale_s
        self._clock = clock
        self._others: tuple[Member, ...] | None = None
        self._read_at = 0.0
        self._ranks: dict[str, int] = {}
        # Each recent epoch's replicas in rendezvous order.
        self._orders: dict[int, Order] = {}
        self._epoch_s = EPOCH_S
        # What this replica declares (update()), and each recent epoch's place (place()).
        self._mine: frozenset[str] | None = None
        self._places: dict[int, int] = {}

    @property
    def members(self) -> tuple[Member, ...] | None:
        """The other live replicas of the current view (``None``: no view)."""
        return self._others

    def update(self, members: Iterable[Member], declared: frozenset[str] | None = None) -> None:
        """Replace the view: the live replicas just read (this replica's own entry is ignored),
        and ``declared``, the schedules this replica declared when they were read (``None``: not
        known; :meth:`place` is then 0).

        The ranks already computed are adjusted for the replicas that joined or left (one hash
        per schedule and such replica) and for those whose declarations changed (one hash per
        name added or dropped), not computed again: a view change costs a fleet of 10,000
        schedules milliseconds, not the hundred-odd a full recount takes at 24 replicas.
        """
        others = tuple(
            sorted(
                (m for m in members if m.replica_id != self.replica_id),
                key=lambda m: m.replica_id,
            )
        )
        old = self._others
        self._read_at = self._clock()
        if declared is not self._mine:
            self._mine = declared
            self._places = {}
        if others == old:
            return
        self._others = others
        self._orders = {}
        self._places = {}
        if old is None:
            self._ranks = {}
            return
        left = set(old) - set(others)
        joined = set(others) - set(old)
        ranks = self._ranks
        # A replica whose declarations changed (a stored schedule created: every replica's
        # do) moves only the ranks of the names it added or dropped.
        replaced = {m.replica_id: m for m in left if m.names is not None}
        for m in list(joined):
            gone = replaced.get(m.replica_id)
            if gone is None or gone.names is None or m.names is None:
                continue
            left.discard(gone)
            joined.discard(m)
            for names, step in ((gone.names - m.names, -1), (m.names - gone.names, 1)):
                for name in names:
                    rank = ranks.get(name)
                    if rank is not None and (_score(name, m.replica_id), m.replica_id) > (
                        _score(name, self.replica_id),
                        self.replica_id,
                    ):
                        ranks[name] = rank + step
        if not left and not joined:
            return
        for name, rank in ranks.items():
            mine = (_score(name, self.replica_id), self.replica_id)
            for m in left:
                if (m.names is None or name in m.names) and (
                    _score(name, m.replica_id),
                    m.replica_id,
                ) > mine:
                    rank -= 1
            for m in joined:
                if (m.names is None or name in m.names) and (
                    _score(name, m.replica_id),
                    m.replica_id,
                ) > mine:
                    rank += 1
            ranks[name] = rank

    def forget(self) -> None:
        """Drop the view: every tick is asked for here again."""
        self._others = None
        self._ranks = {}
        self._orders = {}
        self._places = {}

    def _fresh(self) -> tuple[Member, ...] | None:
        """The other replicas of the view, or ``None`` (no view, or one gone stale: dropped)."""
        if self._others is not None and self._clock() - self._read_at > self._stale_s:
            self.forget()
        return self._others

    def order(self, instant: datetime) -> Order | None:
        """The live replicas in the rendezvous order of ``instant``'s epoch, as the view has
        them now (``None``: no fresh view): to rank the instant's ticks later as they ranked
        at the instant (:meth:`fire_rank`)."""
        others = self._fresh()
        if others is None:
            return None
        return self._order(others, int(instant.timestamp() // self._epoch_s))

    def fire_rank(self, name: str, instant: datetime, order: Order | None = None) -> int:
        """This replica's place among the owners of ``name``'s tick at ``instant`` (0 first;
        :data:`OWNERS` for any place from there on; 0 without a fresh view): the live replicas
        that declare ``name``, in the rendezvous order of the instant's epoch, which every
        schedule due in it shares; or in ``order``, that order as :meth:`order` read it
        earlier."""
        if order is None:
            order = self.order(instant)
            if order is None:
                return 0
        rank = 0
        for m in order:
            if m is None:
                return rank
            if m.names is None or name in m.names:
                rank += 1
                if rank == OWNERS:
                    return rank  # not an owner: how far below does not matter
        return rank  # pragma: no cover - this replica is always in its own order

    def _order(self, others: tuple[Member, ...], epoch: int) -> Order:
        """The live replicas in the rendezvous order of ``epoch`` (``None``: this replica)."""
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) >= _MAX_ORDERS:
                self._orders.clear()
                self._places.clear()
            key = str(epoch)
            scored: list[tuple[tuple[bytes, str], Member | None]] = [
                ((_score(key, m.replica_id), m.replica_id), m) for m in others
            ]
            scored.append(((_score(key, self.replica_id), self.replica_id), None))
            scored.sort(key=lambda item: item[0], reverse=True)
            order = self._orders[epoch] = tuple(m for _, m in scored)
        return order

    def place(self, instant: datetime, names: Iterable[str]) -> int:
        """This replica's place among the owners of the ticks of ``names`` at ``instant``, at
        the least (0 first; :data:`OWNERS` for any place from there on): the replicas before it
        in the instant's epoch order that declare every schedule this replica declares. 0
        without a fresh view, or when one of ``names`` is not among those this replica declared
        when the view was read (its owners are not known to be those)."""
        others = self._fresh()
        mine = self._mine
        if others is None or mine is None:
            return 0
        epoch = int(instant.timestamp() // self._epoch_s)
        place = self._places.get(epoch)
        if place is None:
            place = 0
            for m in self._order(others, epoch):
                if m is None or place == OWNERS:
                    break
                if m.names is None or m.names is mine or m.names >= mine:
                    place += 1
            self._places[epoch] = place
        return place if place == 0 or mine.issuperset(names) else 0

    def rank(self, name: str) -> int:
        """This replica's place among the owners of ``name``'s duties (start-up catch-up, the
        sweep): by a hash of (schedule, replica id) (0 first; 0 without a fresh view)."""
        others = self._fresh()
        if others is None:
            return 0
        rank = self._ranks.get(name)
        if rank is None:
            mine = (_score(name, self.replica_id), self.replica_id)
            rank = sum(
                1
                for m in others
                if (m.names is None or name in m.names)
                and (_score(name, m.replica_id), m.replica_id) > mine
            )
            self._ranks[name] = rank
        return rank

    def owns(self, name: str) -> bool:
        """Whether this replica is one of the :data:`OWNERS` of ``name``."""
        return self.rank(name) < OWNERS
