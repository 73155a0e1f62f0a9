"""The test project with Django's server-side binding cursors (``server_side_binding``)."""

from .settings import *  # noqa: F403
from .settings import DATABASES

# The base settings' OPTIONS hold strings only; this one option is a bool.
DATABASES["default"]["OPTIONS"] = {"sslmode": "disable", "server_side_binding": True}  # type: ignore[dict-item]
