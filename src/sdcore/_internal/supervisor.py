"""``Supervisor``: one ``asyncio.TaskGroup`` that owns a component's background loops.

Policy (the same for every component that uses it):

- **A loop that raises is logged and restarted** (``restart=True``, the default), after a back-off
  that doubles from ``backoff_s`` up to ``backoff_max_s`` and starts over once a run lasted
  ``stable_s``. A background loop has nobody to raise to; stopping it silently (the bug of a bare
  ``asyncio.create_task``) would leave the replica up and doing nothing. A child spawned with
  ``restart=False`` (a one-shot task) is logged once and its error kept in :attr:`failures`.
- **A loop that returns is done** (not restarted): returning is how a loop says it has finished.
- **Nothing outlives** :meth:`aclose`: children get ``grace_s`` to finish on their own (their owner
  asks them to stop first), then the rest are cancelled, each named in a warning, and awaited.
  Children spawned with ``cancel_on_close=True`` (loops that never end by themselves, like a
  LISTEN connection) are cancelled at once. If :meth:`aclose` itself is cancelled, the group
  cancels every child before the cancellation propagates.

The children run inside a ``TaskGroup`` held by one host task, so a child can never be
garbage-collected while running, and an error can never go unobserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from sdcore._internal.errors import error_text
from sdcore._internal.redact import redact_text
from sdcore._internal.validation import positive_number

Factory = Callable[[], Coroutine[Any, Any, None]]


class Supervisor:
    """Owns background tasks in one ``TaskGroup``; see the module docstring for the policy.

    Args:
        name: Prefix of the children's task names and of log lines.
        logger: Where crashes, restarts and forced cancellations are logged.
        backoff_s: First restart delay.
        backoff_max_s: Largest restart delay.
        stable_s: A run that lasted this long resets the back-off.
    """

    def __init__(
        self,
        name: str,
        *,
        logger: logging.Logger,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        stable_s: float = 60.0,
    ) -> None:
        positive_number("backoff_s", backoff_s, maximum=backoff_max_s)
        self.name = name
        self._log = logger
        self._backoff = backoff_s
        self._backoff_max = backoff_max_s
        self._stable = stable_s
        self._group: asyncio.TaskGroup | None = None
        self._host: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._release = asyncio.Event()
        self._children: dict[asyncio.Task[None], bool] = {}  # task -> cancel_on_close
        self.failures: list[tuple[str, BaseException]] = []
        """``(child name, error)`` of every crash (restarted or not), oldest first, at most 100."""
        self.restarts = 0
        """How many times a crashed child was restarted."""

    @property
    def running(self) -> bool:
        """Between :meth:`start` and the end of :meth:`aclose`."""
        return self._host is not None and not self._host.done()

    async def start(self) -> None:
        """Open the task group (in its host task); :meth:`spawn` works once this returns."""
        if self._host is not None:
            return
        self._release.clear()
        self._ready.clear()
        self._host = asyncio.get_running_loop().create_task(self._hold(), name=self.name)
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait({ready, self._host}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._host.done():  # pragma: no cover - the host cannot fail before it is ready
            self._host.result()

    async def _hold(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._ready.set()
            await self._release.wait()
        self._group = None

    def spawn(
        self,
        name: str,
        factory: Factory,
        *,
        restart: bool = True,
        cancel_on_close: bool = False,
    ) -> asyncio.Task[None]:
        """Run ``factory()`` as a child; return its task (to await or cancel it alone).

        Args:
            name: The child's name (its task is ``"<supervisor>-<name>"``).
            factory: Makes the coroutine; called again for each restart.
            restart: Restart after an exception (else log it once and keep it in ``failures``).
            cancel_on_close: Cancel at :meth:`aclose` without waiting for the grace.

        Raises:
            RuntimeError: :meth:`start` was not awaited, or :meth:`aclose` has begun.
        """
        if self._group is None or self._release.is_set():
            raise RuntimeError(f"supervisor {self.name!r} is not running")
        task = self._group.create_task(
            self._guard(name, factory, restart), name=f"{self.name}-{name}"
        )
        self._children[task] = cancel_on_close
        task.add_done_callback(self._children.pop)
        return task

    async def _guard(self, name: str, factory: Factory, restart: bool) -> None:
        loop = asyncio.get_running_loop()
        delay = self._backoff
        while True:
            started = loop.time()
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged here: nobody else can see it
                self.failures = [*self.failures[-99:], (name, exc)]
                if loop.time() - started >= self._stable:
                    delay = self._backoff
                self._log.error(
                    "%s-%s crashed%s: %s",
                    self.name,
                    name,
                    f"; restarting in {delay:.1f} s" if restart else "",
                    redact_text(error_text(exc)[:500]),
                    exc_info=exc,
                    extra={"action": "task_crashed", "task": f"{self.name}-{name}"},
                )
                if not restart:
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_max)
            self.restarts += 1

    async def aclose(self, grace_s: float | None = 10.0) -> None:
        """Wait up to ``grace_s`` (``None``: as long as it takes) for the children, then cancel.

        Children spawned with ``cancel_on_close`` are cancelled at once. Every child has ended
        when this returns.
        """
        host = self._host
        if host is None:
            return
        self._release.set()
        try:
            for task, cancel in list(self._children.items()):
                if cancel:
                    task.cancel()
            children = set(self._children)
            if children:
                _, late = await asyncio.wait(children, timeout=grace_s)
                for task in late:
                    self._log.warning(
                        "%s still running after %.1f s: cancelling it",
                        task.get_name(),
                        grace_s or 0.0,
                        extra={"action": "task_cancelled", "task": task.get_name()},
                    )
                    task.cancel()
            await asyncio.shield(host)
        except asyncio.CancelledError:
            host.cancel()  # the group cancels every child, then the host ends
            with contextlib.suppress(asyncio.CancelledError):
                await host
            raise
        finally:
            if host.done():
                self._host = None
