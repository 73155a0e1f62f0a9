"""The multi-replica demo behind ``sdcore demo`` (needs ``sdcore[demo]``)."""

from sdcore.demo._embedded import EmbeddedUnavailableError, embedded_postgres
from sdcore.demo._run import DemoOptions, run_demo
from sdcore.demo._verdict import Takeover, Verdict, compute_verdict

__all__ = [
    "DemoOptions",
    "EmbeddedUnavailableError",
    "Takeover",
    "Verdict",
    "compute_verdict",
    "embedded_postgres",
    "run_demo",
]
