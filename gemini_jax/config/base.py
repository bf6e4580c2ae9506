"""What every config module shares: the refusal, nested configs from mappings, and `from_dict`.

A config validates itself once, at construction, and names the field, the value and what is
allowed when it refuses (`ConfigError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gemini_jax.errors import ConfigError


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def nested(obj, name: str, cls) -> None:
    """Field `name` of the frozen config `obj`, given as a mapping (a Hydra node, a dict), becomes
    a `cls` through `from_dict` (the one mapping -> config path)."""
    value = getattr(obj, name)
    if isinstance(value, Mapping):
        object.__setattr__(obj, name, from_dict(cls, value, where=f"{type(obj).__name__}.{name}"))


def replace(cfg, **changes):
    """`dataclasses.replace` that re-runs validation."""
    return dataclasses.replace(cfg, **changes)


def from_dict(cls, data: Mapping[str, Any], *, where: str | None = None):
    """Build a config dataclass from a plain mapping (e.g. a Hydra node), refusing unknown keys.
    Nested configs may be mappings too: each config's `__post_init__` sends them back here."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__}.")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where} got unknown field(s) {unknown}; allowed: {sorted(names)}.")
    try:
        return cls(**data)
    except TypeError as e:  # missing required field
        raise ConfigError(f"{where}: {e}") from None
