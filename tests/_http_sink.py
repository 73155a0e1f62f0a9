"""A real HTTP server on a spare loopback port that records what it is sent (webhooks, pings).

``http.server`` in a thread of the test process: the code under test reaches it over a real
socket, from this process or from replica processes. It answers 200, or the statuses queued in
:attr:`HttpRecorder.fail_next` first (a receiver that is down for a while).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int

    def json(self) -> Any:
        return json.loads(self.body)


class HttpRecorder:
    """The recording server's state (thread-safe)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.fail_next: list[int] = []
        self._lock = threading.Lock()
        self.url = ""

    def record(self, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
        with self._lock:
            status = self.fail_next.pop(0) if self.fail_next else 200
            self.received.append(Received(method, path, headers, body, status))
            return status

    def ok(self, path_prefix: str = "/") -> list[Received]:
        """The requests answered 2xx whose path starts with ``path_prefix``."""
        with self._lock:
            return [r for r in self.received if r.status == 200 and r.path.startswith(path_prefix)]

    def wait_for(self, check: Callable[[HttpRecorder], bool], timeout_s: float = 10.0) -> bool:
        """Poll until ``check(self)`` holds (``False`` after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check(self):
                return True
            time.sleep(0.05)
        return check(self)


@contextmanager
def http_recorder(port: int = 0) -> Iterator[HttpRecorder]:
    """Serve on ``127.0.0.1`` at ``port`` (0: a free one) until the block ends; yields the
    recorder."""
    recorder = HttpRecorder()

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            status = recorder.record(self.command, self.path, dict(self.headers.items()), body)
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_POST = do_GET = do_HEAD = _any

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return None

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="http-recorder", daemon=True)
    thread.start()
    try:
        yield recorder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
