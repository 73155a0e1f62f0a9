"""Connection strings: passwords never appear in output, logs or errors."""

from __future__ import annotations

from sdcore._internal.redact import redact_dsn, redact_text

__all__ = ["redact_dsn", "redact_text"]
