"""``Sdcore``: the :class:`sdcore.runtime.Runtime` under the name the FastAPI integration uses."""

from __future__ import annotations

from sdcore.runtime import ComponentHealth, Runtime

__all__ = ["ComponentHealth", "Sdcore"]


class Sdcore(Runtime):
    """The framework-free :class:`~sdcore.runtime.Runtime`, as ``sdcore.fastapi`` names it.

    ``FastAPI(lifespan=sd.lifespan)`` starts it with the app and stores it in
    ``app.state.sdcore`` for the ``*Dep`` dependencies. Every argument is the Runtime's; only
    the default logger differs (``sdcore.fastapi``).
    """

    default_logger_name = "sdcore.fastapi"
