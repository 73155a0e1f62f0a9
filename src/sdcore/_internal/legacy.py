"""Keyword arguments that moved into a settings object: still taken, with a DeprecationWarning.

Each warning names the new spelling exactly (``Runtime(pool_max_size=…) is deprecated: use
Runtime(pool=PoolSettings(max_size=…))``), and the old keywords build the same settings object
the new spelling does. Giving an old keyword together with the settings object that now holds it
is refused: which of the two was meant cannot be told.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Settings = TypeVar("Settings", bound=DataclassInstance)
else:
    Settings = TypeVar("Settings")

__all__ = ["fold_moved", "refuse_unknown", "warn_switch"]


def fold_moved(
    call: str,
    group: str,
    settings: Settings,
    *,
    moved: Mapping[str, str],
    given: Mapping[str, object],
    explicit: bool,
    stacklevel: int,
    spelled: Mapping[str, object] | None = None,
) -> Settings:
    """Return ``settings`` with the old keywords of one group applied, each after a warning.

    Args:
        call: How the call reads in messages (``"Runtime"``).
        group: The new keyword that holds the settings object (``"pool"``).
        settings: The settings object to start from (the default one, unless ``explicit``).
        moved: Old keyword → field of the settings object (``"pool_max_size": "max_size"``).
        given: The keyword arguments of the call (those not in ``moved`` are ignored).
        explicit: Whether the caller gave ``group`` too (then no old keyword may be given).
        stacklevel: ``warnings.warn``'s, counted from this function's caller.
        spelled: Fields whose value in ``settings`` differs from the class default, named in
            the warnings unless given (``{"max_size": 4}``: ``PoolSettings(max_size=4, …)``).

    Returns:
        A copy with the old keywords' values, validated by the settings' ``__post_init__``.

    Raises:
        TypeError: An old keyword given together with ``group``.
        ValueError: A value the settings object refuses (naming its field).
    """
    found = {old: given[old] for old in moved if old in given}
    if not found:
        return settings
    kind = type(settings).__name__
    if explicit:
        old = next(iter(found))
        raise TypeError(
            f"{call}({old}=…) cannot be combined with {call}({group}=…): give "
            f"{kind}({moved[old]}=…) only"
        )
    fields = {moved[old] for old in found}
    extra = "".join(
        f"{name}={value!r}, " for name, value in (spelled or {}).items() if name not in fields
    )
    for old in found:
        warnings.warn(
            f"{call}({old}=…) is deprecated: use {call}({group}={kind}({extra}{moved[old]}=…))",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
    return dataclasses.replace(settings, **{moved[old]: value for old, value in found.items()})


def warn_switch(call: str, old: str, on: bool, group: str, kind: str, *, stacklevel: int) -> None:
    """Warn that ``old=True``/``False`` is now ``group=Kind()``/``group=None``."""
    new = f"{kind}()" if on else "None"
    warnings.warn(
        f"{call}({old}={on}) is deprecated: use {call}({group}={new})",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def refuse_unknown(call: str, given: Mapping[str, object], known: set[str]) -> None:
    """Raise as Python does for a keyword argument the call does not take.

    Raises:
        TypeError: Naming the first unknown keyword.
    """
    for name in given:
        if name not in known:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")
