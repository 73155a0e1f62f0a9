"""What stops the started ``sdcore.sync.Runtime`` objects of a process nobody stopped: interpreter
exit and SIGTERM.

Both are process-wide (one exit, one SIGTERM disposition), so one :class:`ProcessExit` per process
keeps the runtimes started in it. Invariants:

- **Interpreter exit.** Python joins the non-daemon threads and ``concurrent.futures`` refuses new
  work (its own exit hook) *before* ``atexit`` handlers run; a runtime stopped from ``atexit`` would
  find its handler pool closed. The hook is registered with ``threading._register_atexit`` (run at
  the start of threading's shutdown, in reverse order of registration) after importing
  ``concurrent.futures.thread``, so it runs first. Where that CPython function is missing, plain
  ``atexit`` is the fallback (the stop then runs after the pool refused new work).
- **SIGTERM.** Installed only from the main thread, and only over ``SIG_DFL``: a process where
  someone else owns SIGTERM (Gunicorn's workers, a framework, the application) keeps it. The
  handler restores ``SIG_DFL`` at once (a second SIGTERM ends the process at once), then hands
  the stop to a watcher thread — the handler itself takes no lock, since the main thread may hold
  any lock (a logging handler's) where it was interrupted — which stops every runtime within its
  grace period and sends SIGTERM again, so the exit status stays "killed by SIGTERM". A main
  thread inside ``start()`` is interrupted instead (:class:`Terminated`), so a start that waits
  for an unreachable database does not hold the stop.
- **Fork.** Nothing here survives ``fork`` usefully: the child's copy ignores the parent's
  runtimes, and its inherited SIGTERM handler behaves as ``SIG_DFL``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import contextlib
import logging
import os
import queue
import signal
import threading
from types import FrameType
from typing import Protocol

__all__ = ["PROCESS_EXIT", "ProcessExit", "Terminated"]

_log = logging.getLogger("sdcore.sync")
_TERMINATE = "terminate"
_QUIT = "quit"


class Terminated(BaseException):
    """SIGTERM arrived while the main thread was inside ``Runtime.start()``."""


class Stoppable(Protocol):
    """What the registry needs of a runtime."""

    def stop(self) -> None:
        """Stop it (a no-op when stopped)."""

    def starting_in(self, thread_id: int) -> bool:
        """Whether ``thread_id`` is inside this runtime's ``start()``."""


class ProcessExit:
    """The started runtimes of this process, stopped at interpreter exit and on SIGTERM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._runtimes: list[Stoppable] = []
        self._exit_hooked = False
        self._watcher: queue.SimpleQueue[str] | None = None
        self.terminating = False

    def add(self, runtime: Stoppable, *, sigterm: bool) -> None:
        """Stop ``runtime`` at interpreter exit, and on SIGTERM when ``sigterm`` and this is the
        main thread and nobody else handles SIGTERM."""
        with self._lock:
            self._for_this_process()
            if not self._exit_hooked:
                register = getattr(threading, "_register_atexit", None)
                if register is None:
                    atexit.register(self._at_exit)
                else:
                    register(self._at_exit)
                self._exit_hooked = True
            self._runtimes.append(runtime)
            if sigterm and threading.current_thread() is threading.main_thread():
                self._install()

    def remove(self, runtime: Stoppable) -> None:
        """Forget ``runtime`` (stopped); the last one gives SIGTERM back to ``SIG_DFL`` when it
        can (from the main thread)."""
        with self._lock:
            self._for_this_process()
            with contextlib.suppress(ValueError):
                self._runtimes.remove(runtime)
            if not self._runtimes and threading.current_thread() is threading.main_thread():
                self._uninstall()

    def stop_all(self) -> None:
        """Stop every runtime of this process, the latest started first; never raises (it runs
        in threading's shutdown, where an exception would skip the other hooks)."""
        if os.getpid() != self._pid:
            return
        for runtime in reversed(list(self._runtimes)):
            try:
                runtime.stop()
            except Exception:  # noqa: BLE001 - stop the others
                _log.exception("could not stop an sdcore runtime", extra={"action": "stop"})

    def _at_exit(self) -> None:
        self.stop_all()
        if self.terminating and os.getpid() == self._pid:
            _die()  # the watcher may be a frozen daemon thread by now: end it here

    def terminate(self) -> None:
        """Stop every runtime, then end the process with SIGTERM (``SIG_DFL``)."""
        self.terminating = True
        self.stop_all()
        _die()

    def _for_this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's runtimes are not ours
            self._pid = os.getpid()
            self._runtimes = []
            self._watcher = None
            self.terminating = False

    def _install(self) -> None:
        current = signal.getsignal(signal.SIGTERM)
        ours = current == self._on_sigterm  # inherited over a fork: its watcher did not survive
        if current is signal.SIG_DFL or (ours and self._watcher is None):
            watcher: queue.SimpleQueue[str] = queue.SimpleQueue()
            threading.Thread(
                target=self._watch, args=(watcher,), name="sdcore-sigterm", daemon=True
            ).start()
            self._watcher = watcher
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _uninstall(self) -> None:
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self._watcher is not None:
            self._watcher.put(_QUIT)
            self._watcher = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del frame
        # Only signal-safe work here: no lock, no logging (see the module's docstring).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        watcher = self._watcher
        if self._pid != os.getpid() or watcher is None or self.terminating:
            _die()
            return
        self.terminating = True
        me = threading.get_ident()
        if any(runtime.starting_in(me) for runtime in list(self._runtimes)):
            raise Terminated
        watcher.put(_TERMINATE)  # SimpleQueue.put is reentrant: safe in a signal handler

    def _watch(self, watcher: queue.SimpleQueue[str]) -> None:
        if watcher.get() == _TERMINATE:
            _log.info("SIGTERM: stopping sdcore", extra={"action": "sigterm"})
            self.terminate()


def _die() -> None:
    """End the process as SIGTERM's default action does (status "killed by SIGTERM")."""
    with contextlib.suppress(ValueError):  # not the main thread: the handler restored it already
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


PROCESS_EXIT = ProcessExit()
"""The registry of this process (one exit, one SIGTERM disposition)."""
