"""``ENGINE = "tests.django_project.wrapped_backend"``: Django's PostgreSQL backend, subclassed."""

from __future__ import annotations

from django.db.backends.postgresql import base


class DatabaseWrapper(base.DatabaseWrapper):  # type: ignore[misc]
    """Counts nothing, changes nothing: only a backend of its own name."""
