"""Without ``opentelemetry`` or ``prometheus-client`` installed, sdcore works unchanged."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter where the packages cannot be imported (``sys.modules[x] = None``).
_BLOCK = (
    "import sys\n"
    "for name in ('opentelemetry', 'opentelemetry.trace', 'prometheus_client'):\n"
    "    sys.modules[name] = None\n"
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, check=False
    )


def test_a_runtime_without_the_extras_builds_and_logs() -> None:
    done = _run(
        "import logging\n"
        "from sdcore import Runtime\n"
        "from sdcore.jsonlog import JsonFormatter\n"
        "runtime = Runtime(database_url='postgresql://127.0.0.1:1/x')\n"
        "assert runtime.metrics is None and runtime.tracing is None\n"
        "assert not runtime.telemetry.enabled\n"
        "record = logging.LogRecord('x', logging.INFO, 'app.py', 1, 'hello', None, None)\n"
        "print(JsonFormatter().format(record))\n"
    )
    assert done.returncode == 0, done.stderr
    assert '"message":"hello"' in done.stdout
    assert "trace_id" not in done.stdout


def test_asking_for_metrics_or_tracing_without_them_names_the_extra() -> None:
    for option, extra in (("metrics", "sdcore[metrics]"), ("tracing", "sdcore[otel]")):
        done = _run(
            "from sdcore import Runtime\n"
            f"Runtime(database_url='postgresql://127.0.0.1:1/x', {option}=True)\n"
        )
        assert done.returncode != 0
        assert extra in done.stderr, done.stderr


def test_alerting_without_httpx_names_the_extra() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nsys.modules['httpx'] = None\n"
            "from sdcore import Runtime\n"
            "Runtime(database_url='postgresql://127.0.0.1:1/x')\n"  # no alerting: no httpx
            "import sdcore.alerting\n",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert "sdcore[alerting]" in done.stderr, done.stderr
