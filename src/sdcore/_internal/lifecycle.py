"""``AsyncStartStop``: the ``async with`` protocol of every component that starts and stops.

``async with component:`` calls :meth:`start` on entry and :meth:`stop` on exit, whatever ends
the block (an exception, a cancellation). A class that starts and stops under other names keeps
its names and aliases them, e.g. ``stop = close``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["AsyncStartStop"]


class AsyncStartStop:
    """Mixin: ``__aenter__`` awaits :meth:`start` and returns ``self``; ``__aexit__`` awaits
    :meth:`stop` and never swallows the block's exception."""

    async def start(self) -> None:
        """Start the component (the subclass's work)."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop the component (the subclass's work)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
