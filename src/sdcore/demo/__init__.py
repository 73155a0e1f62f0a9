"""The multi-replica demo behind ``sdcore demo`` (needs ``sdcore[demo]``)."""

from sdcore.demo._embedded import EmbeddedUnavailableError, embedded_postgres
from sdcore.demo._run import DemoOptions, Verdict, compute_verdict, run_demo

__all__ = [
    "DemoOptions",
    "EmbeddedUnavailableError",
    "Verdict",
    "compute_verdict",
    "embedded_postgres",
    "run_demo",
]
