"""The portal: an event loop on a thread of its own, and how blocking code calls into it.

Every ``sdcore.sync`` object that holds connections owns a :class:`Portal`; its async twin lives
on the portal's loop, and each blocking method is one :meth:`Portal.call`. Invariants:

- A call runs as a task of the portal's loop, in a copy of the caller's context (context
  variables such as a trace span reach the async code).
- A blocking caller interrupted while it waits (``KeyboardInterrupt``, ``SystemExit`` from a
  signal handler) cancels its task and waits for the task to unwind before re-raising: nothing
  it started is left running behind it. A second interrupt leaves at once.
- :meth:`Portal.call_here` runs the plain functions the task hands to a worker thread (the
  lease's ``run_exclusive``) in the *caller's* thread instead, while the caller waits; an
  interrupt raised by such a function reaches the task as :class:`CallerInterrupted` (an
  ``Exception``: a ``KeyboardInterrupt`` inside an asyncio task would stop the loop) and is
  re-raised as itself in the caller once the task has recorded the failure.
- A portal is tied to the process that started it: its thread does not survive ``fork``, so a
  call from a forked child is refused with an error that says where to start it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import os
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from sdcore._internal.threads import PLAIN_CALLS
from sdcore.runtime import RuntimeStateError

__all__ = ["CallerInterrupted", "Portal"]

T = TypeVar("T")
P = ParamSpec("P")

# How long stop() waits for the loop's thread after the loop was told to stop.
_JOIN_TIMEOUT_S = 30.0


class CallerInterrupted(Exception):
    """A ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) raised by a plain function the
    portal ran in the caller's thread, carried through the loop as an ``Exception``."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__} in the caller's thread")
        self.original = original


class _Call:
    """One call into the loop: its task (once spawned) and the future the caller waits on."""

    __slots__ = ("cancelled", "future", "task")

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.task: asyncio.Task[Any] | None = None
        self.cancelled = False


class _CallerThread(concurrent.futures.Executor):
    """An executor whose work runs in the thread that calls :meth:`serve` (the blocking caller).

    Every future it hands out is settled on the portal's loop, never in the caller's thread: an
    interrupt may land anywhere in that thread (inside ``Future.set_result``, between the state
    change and the callback that wakes the awaiting task), so the caller only passes outcomes to
    the loop, and once interrupted (:meth:`close`) passes it the interrupt for whatever is not
    settled yet. Settling a settled future is a no-op, so both may arrive. Work submitted after
    :meth:`close` is cancelled at once: the task awaiting it never waits on a thread that
    stopped serving.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ]
        self._items = queue.SimpleQueue()
        self._pending: set[concurrent.futures.Future[Any]] = set()  # the loop's thread only
        self._closed = False

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        # Called on the loop's thread (run_in_executor), as _abandon is: they never interleave.
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._closed:
            future.cancel()
        else:
            self._pending.add(future)
            self._items.put((future, lambda: fn(*args, **kwargs)))
        return future

    def serve(self, done: concurrent.futures.Future[Any]) -> None:
        """Run submitted work in this thread until ``done`` is done."""
        done.add_done_callback(lambda _: self._items.put(None))
        while True:
            item = self._items.get()
            if item is None:
                return
            future, work = item
            del item
            if not future.set_running_or_notify_cancel():
                continue
            outcome: BaseException | None = None
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - handed to the task that awaits it
                outcome, result = exc, None
            except BaseException as exc:  # noqa: BLE001 - carried through the loop, re-raised
                outcome, result = CallerInterrupted(exc), None
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits it
                self._loop.call_soon_threadsafe(self._finish, future, result, outcome)
            del future, work, result, outcome

    def _finish(
        self, future: concurrent.futures.Future[Any], result: Any, exc: BaseException | None
    ) -> None:
        self._pending.discard(future)
        if future.done():
            return
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)

    def close(self, interrupt: BaseException) -> None:
        """Refuse new work; on the loop, cancel the work not started and settle the work
        started with ``interrupt`` (unless its outcome arrived first)."""
        self._closed = True
        with contextlib.suppress(RuntimeError):  # the loop closed: its tasks are gone
            self._loop.call_soon_threadsafe(self._abandon, interrupt)

    def _abandon(self, interrupt: BaseException) -> None:
        pending, self._pending = self._pending, set()
        for future in pending:
            if not future.done() and not future.cancel():
                future.set_exception(CallerInterrupted(interrupt))


class Portal:
    """An asyncio event loop running on a thread of its own.

    Args:
        name: The thread's name (shown in thread dumps and ``py-spy``).
        handler_threads: Size of the loop's default executor, where plain functions of the
            async core run (scheduler handlers); ``None`` keeps asyncio's default. Stopping
            the portal does not wait for a plain function still running in that executor
            (with ``None``, it does, as ``asyncio.run`` does).
    """

    def __init__(self, *, name: str, handler_threads: int | None = None) -> None:
        self.name = name
        self.handler_threads = handler_threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Every call whose caller still waits: once the loop stops taking calls (the start of
        # its shutdown), none is added; those left unsettled after the loop closed (their spawn
        # never ran) are cancelled then, so that no caller waits for ever.
        self._calls: set[_Call] = set()
        self._calls_lock = threading.Lock()
        self._accepting = False  # written on the loop's thread only

    @property
    def running(self) -> bool:
        """Whether the loop's thread runs (in this process)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._pid == os.getpid()

    @property
    def accepting(self) -> bool:
        """Whether the loop takes calls (it runs in this process and is not shutting down)."""
        return self._accepting and self.running

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The portal's event loop.

        Raises:
            RuntimeStateError: The portal is not running (in this process).
        """
        self._check_process()
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeStateError(f"the {self.name} portal is not running: start it first")
        return loop

    def start(self) -> None:
        """Start the loop's thread (a no-op when it runs already)."""
        with self._lock:
            if self._thread is not None and self._pid != os.getpid():
                self._thread = self._loop = None  # a parent's portal: start afresh in the child
                self._pid = os.getpid()
            if self._thread is not None and self._thread.is_alive():
                return
            self._pid = os.getpid()  # built before a fork, started after: this process's
            ready = threading.Event()
            thread = threading.Thread(target=self._main, args=(ready,), name=self.name, daemon=True)
            thread.start()
            ready.wait()
            self._thread = thread

    def stop(self) -> None:
        """Stop the loop (cancelling what still runs on it) and wait for its thread.

        Raises:
            RuntimeStateError: Called from the portal's own thread.
        """
        with self._lock:
            thread, loop = self._thread, self._loop
            if thread is None or loop is None or self._pid != os.getpid():
                return
            if threading.get_ident() == thread.ident:
                raise RuntimeStateError(f"the {self.name} portal cannot stop itself")
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    loop.call_soon_threadsafe(loop.stop)
            thread.join(_JOIN_TIMEOUT_S)
            self._thread = None

    def call(
        self, fn: Callable[P, Coroutine[Any, Any, T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop and return its result (or raise its error).

        Raises:
            RuntimeStateError: The portal is not running, or the call comes from the loop's own
                thread or from a running event loop (it would block that loop).
        """
        return self._run(fn(*args, **kwargs), here=False)

    def call_here(
        self, fn: Callable[P, Coroutine[Any, Any, T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """:meth:`call`, with the plain functions the call runs in a worker thread (see
        :data:`sdcore._internal.threads.PLAIN_CALLS`) run in this thread instead."""
        return self._run(fn(*args, **kwargs), here=True)

    def _run(self, coro: Coroutine[Any, Any, T], *, here: bool) -> T:
        try:
            loop = self._check_caller()
        except BaseException:
            coro.close()
            raise
        call = _Call()
        context = contextvars.copy_context()
        caller = _CallerThread(loop) if here else None
        if caller is not None:
            context.run(PLAIN_CALLS.set, caller)
        with self._calls_lock:
            if not self._accepting:  # the loop shuts down (or is gone) since the check
                coro.close()
                raise RuntimeStateError(f"the {self.name} portal is not running")
            self._calls.add(call)
        # From here on an interrupt may land at any bytecode, the spawn's included: whatever
        # it interrupts, the except below cancels the call and waits for it to settle.
        try:
            call.future.add_done_callback(lambda _: self._forget(call))
            try:
                loop.call_soon_threadsafe(self._spawn, call, coro, context)
            except RuntimeError:  # the loop closed between the check and here
                coro.close()
                _cancelled(call.future)
                raise RuntimeStateError(f"the {self.name} portal is not running") from None
            if caller is None:
                concurrent.futures.wait([call.future])
            else:
                caller.serve(call.future)
        except BaseException as exc:
            # Interrupted while waiting: cancel the task and let it unwind (a second interrupt
            # leaves at once).
            if caller is not None:
                caller.close(exc)
            self._cancel(loop, call)
            concurrent.futures.wait([call.future])
            if call.task is None:  # never spawned (or refused at its spawn): nothing ran it
                coro.close()
            raise
        result: T = self._result(call, self.name)
        return result

    @staticmethod
    def _result(call: _Call, name: str) -> Any:
        future = call.future
        if future.cancelled():
            raise RuntimeStateError(f"the {name} portal stopped while the call ran")
        exc = future.exception()
        if exc is None:
            return future.result()
        if isinstance(exc, CallerInterrupted):
            raise exc.original from None
        raise exc

    def _forget(self, call: _Call) -> None:
        with self._calls_lock:
            self._calls.discard(call)

    def _spawn(
        self, call: _Call, coro: Coroutine[Any, Any, Any], context: contextvars.Context
    ) -> None:
        if call.cancelled or not self._accepting:
            # A spawn that runs while the loop shuts down would start a task after shutdown
            # cancelled the others: nothing would end it.
            coro.close()
            _cancelled(call.future)
            return
        task = asyncio.get_running_loop().create_task(coro, context=context)
        call.task = task
        task.add_done_callback(lambda done: _settle(call.future, done))

    @staticmethod
    def _cancel(loop: asyncio.AbstractEventLoop, call: _Call) -> None:
        def cancel() -> None:
            # Runs after the call's spawn if the spawn was scheduled at all; if it was not (the
            # caller was interrupted first), nothing else would settle the call's future.
            call.cancelled = True
            if call.task is not None:
                call.task.cancel()
            elif not call.future.done():
                _cancelled(call.future)

        with contextlib.suppress(RuntimeError):  # closed: its tasks were cancelled with it
            loop.call_soon_threadsafe(cancel)

    def _check_process(self) -> None:
        if self._pid != os.getpid() and self._thread is not None:
            raise RuntimeStateError(
                f"the {self.name} portal was started in process {self._pid} before a fork: "
                "start sdcore.sync objects in the process that uses them (under Gunicorn, in "
                "post_fork, or lazily on first use)"
            )

    def _check_caller(self) -> asyncio.AbstractEventLoop:
        loop = self.loop
        thread = self._thread
        if thread is not None and threading.get_ident() == thread.ident:
            raise RuntimeStateError(
                "a blocking sdcore.sync call from the portal's own event loop would wait for "
                "itself: await the async API there"
            )
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return loop
        raise RuntimeStateError(
            "a blocking sdcore.sync call from a running event loop would block it: use the "
            "async API (sdcore.job_scheduler, sdcore.Runtime) in async code"
        )

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        handlers: concurrent.futures.ThreadPoolExecutor | None = None
        if self.handler_threads is not None:
            handlers = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.handler_threads, thread_name_prefix=f"{self.name}-handler"
            )
            loop.set_default_executor(handlers)
        asyncio.set_event_loop(loop)
        self._loop = loop
        with self._calls_lock:
            self._accepting = True
        ready.set()
        try:
            loop.run_forever()
        finally:
            with self._calls_lock:
                self._accepting = False
            try:
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                if handlers is None:
                    loop.run_until_complete(loop.shutdown_default_executor())
                else:
                    # The owner's stop gave plain functions their grace period already (and
                    # waits itself for those holding a lease): one still running is not waited
                    # for here; its thread ends when the function returns.
                    handlers.shutdown(wait=False, cancel_futures=True)
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                with self._calls_lock:
                    left = list(self._calls)
                for call in left:
                    if not call.future.done():
                        _cancelled(call.future)


def _settle(future: concurrent.futures.Future[Any], task: asyncio.Task[Any]) -> None:
    """Copy a finished task's outcome to the future its caller waits on."""
    if task.cancelled():
        _cancelled(future)
        return
    exc = task.exception()
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())


def _cancelled(future: concurrent.futures.Future[Any]) -> None:
    """Cancel ``future`` and wake its waiters: ``Future.cancel()`` alone wakes
    ``concurrent.futures.wait`` only through the executor's ``set_running_or_notify_cancel()``,
    which no executor calls here."""
    future.cancel()
    future.set_running_or_notify_cancel()
