"""Study workloads, one module each, run by `experiments/run.py experiment=<study>`.

Every study module has

    Config                        frozen dataclass: the keys of conf/experiment/<study>.yaml (less
                                  `name`, which selects the study), validated at construction
    run(cfg) -> StudyResult       the workload: loads its model, runs, returns the rows
    markdown(record) -> str       the .md written beside the record (gemini_jax.eval.record)

`experiments/run.py` builds the Config from the experiment node, runs the study and writes the
record to `<results_dir>/<study>/<name>.json` + `.md`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gemini_jax.errors import ConfigError

NAMES = ("needle_keys", "needle_diagnose", "digest_recall", "tier_scale", "tier_hit_rate", "exactness", "align_pages")


def load(name: str) -> ModuleType:
    """The study module `name`; ConfigError names the studies there are."""
    if name not in NAMES:
        raise ConfigError(f"study {name!r} is not one of {list(NAMES)}.")
    return importlib.import_module(f"gemini_jax.eval.studies.{name}")


def as_tuple(cfg, field: str, kind) -> None:
    """Freeze list field `field` of the frozen dataclass `cfg` into a tuple of `kind` (YAML gives lists)."""
    value = getattr(cfg, field)
    if value is None:
        return
    try:
        object.__setattr__(cfg, field, tuple(kind(v) for v in value))
    except (TypeError, ValueError):
        raise ConfigError(f"{type(cfg).__name__}.{field}={value!r} must be a list of {kind.__name__}.") from None
    if not getattr(cfg, field):
        raise ConfigError(f"{type(cfg).__name__}.{field} is empty; give at least one value.")


def choice(cfg, field: str, allowed: tuple) -> None:
    """ConfigError unless `cfg.field` is one of `allowed`."""
    value = getattr(cfg, field)
    if value not in allowed:
        raise ConfigError(f"{type(cfg).__name__}.{field}={value!r} must be one of {list(allowed)}.")
