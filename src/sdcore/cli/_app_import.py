"""Import the module an ``--app`` / ``sdcore run`` spec names, without running its program.

A script such as ``asyncio.run(main())`` at module level, unguarded by
``if __name__ == "__main__":``, would start the application inside the CLI when imported: the
CLI would become one more live replica, running real ticks, and a command meant to read would
block until Ctrl-C. While the module is imported, every way into an asyncio event loop
(``asyncio.run``, ``asyncio.Runner.run``, a loop's ``run_forever`` / ``run_until_complete``)
refuses to start, so the import stops at that line before anything runs and the CLI says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from sdcore.cli._format import escape


class ProgramStartedError(BaseException):
    """The imported module started an event loop (a ``BaseException``: an application's
    ``except Exception`` around its own start-up must not swallow it)."""

    def __init__(self, how: str, where: str) -> None:
        self.how = how
        self.where = where
        super().__init__(f"{how} at {where}")


_lock = threading.Lock()


def _caller(depth: int = 2) -> str:
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            if frame is None:
                break
            frame = frame.f_back
        if frame is None:
            return "import time"
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    finally:
        del frame


@contextlib.contextmanager
def _event_loops_refused() -> Iterator[None]:
    loop_class = asyncio.BaseEventLoop
    targets: dict[tuple[Any, str], str] = {
        (asyncio, "run"): "asyncio.run()",
        (asyncio.Runner, "run"): "asyncio.Runner.run()",
        (loop_class, "run_forever"): "loop.run_forever()",
        (loop_class, "run_until_complete"): "loop.run_until_complete()",
    }
    importing = threading.get_ident()
    window = {"open": True}

    def refuse(how: str, original: Any) -> Any:
        # A module may keep the function it imported (`from asyncio import run`): outside the
        # import, or on another thread, it is the original, so nothing is refused later.
        def refused(*args: Any, **kwargs: Any) -> Any:
            if not window["open"] or threading.get_ident() != importing:
                return original(*args, **kwargs)
            for value in (*args, *kwargs.values()):
                if inspect.iscoroutine(value):
                    value.close()  # never awaited on purpose: no "never awaited" warning
            raise ProgramStartedError(how, _caller())

        return refused

    with _lock:
        saved = {key: getattr(key[0], key[1]) for key in targets}
        for (owner, name), how in targets.items():
            setattr(owner, name, refuse(how, saved[(owner, name)]))
        try:
            yield
        finally:
            window["open"] = False
            for (owner, name), original in saved.items():
                setattr(owner, name, original)


def import_app_module(module_name: str) -> ModuleType:
    """Import ``module_name`` (the current directory first on ``sys.path``, as uvicorn does).

    Raises:
        ProgramStartedError: Importing it started an event loop (nothing ran: the loop was
            refused before it started); :func:`program_started_message` words it.
        ImportError: The module (or one it imports) cannot be found.
        Exception: Whatever the module raised while it was imported.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if module_name in sys.modules:
        return sys.modules[module_name]
    try:
        with _event_loops_refused():
            return importlib.import_module(module_name)
    except ProgramStartedError:
        # A half-executed module must not be found by a later import in this process.
        sys.modules.pop(module_name, None)
        raise


def program_started_message(module_name: str, exc: ProgramStartedError) -> str:
    """One line: what the import tried to start, where, and how to fix the module."""
    return (
        f"importing {escape(module_name)} starts its program ({exc.how} at {exc.where}); "
        'nothing was started. Guard that call with `if __name__ == "__main__":` and expose '
        "the Runtime or Scheduler at module level (e.g. `runtime = Runtime(...)`), then name it "
        f"as {escape(module_name)}:runtime"
    )
