"""Hydra structured configs, mirrored from the frozen dataclasses in `gemini_jax.config`.

OmegaConf makes frozen dataclasses read-only, which would refuse command-line overrides, so
the schema Hydra sees is a mutable mirror generated from the same fields (same names, types and
defaults). Hydra type-checks overrides against it; the job then builds the frozen, validated
dataclass with `gemini_jax.config.from_dict`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import typing
from typing import Any, Dict, List, Optional

from gemini_jax import config


def _mirror_type(tp):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return schema_of(tp)
    if origin is typing.Literal:  # OmegaConf has no Literal: the type of its values (the config checks them)
        return type(args[0])
    if origin is tuple:
        return List[args[0]]
    if origin is dict or tp is dict:
        return Dict[str, Any]
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)][0]
        return Optional[_mirror_type(inner)]
    return tp


@functools.lru_cache(maxsize=None)
def schema_of(cls):
    """A mutable dataclass with the fields of the frozen config `cls`."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        tp = _mirror_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            if isinstance(f.default, tuple):
                fields.append((f.name, tp, dataclasses.field(default_factory=functools.partial(list, f.default))))
            else:
                fields.append((f.name, tp, dataclasses.field(default=f.default)))
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            if dataclasses.is_dataclass(tp):
                factory = tp
            fields.append((f.name, tp, dataclasses.field(default_factory=factory)))
        else:
            fields.append((f.name, tp, dataclasses.field(default=dataclasses.MISSING)))
    return dataclasses.make_dataclass(cls.__name__ + "Schema", fields, kw_only=True)


_REGISTERED = False


def register() -> None:
    """Register schemas (groups model/hardware/engine/sampling/sparse/tier/serve) and the resolvers
    `gj_windows` (per-layer windows) and `gj_run_dir` (a directory of this run's own)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(
        "gj_windows", lambda n, w, p=0: config.windows_spec(int(n), int(w), int(p)), replace=True)
    OmegaConf.register_new_resolver("gj_run_dir", run_dir, replace=True)
    cs = ConfigStore.instance()
    cs.store(group="model", name="schema", node=schema_of(config.ModelConfig))
    cs.store(group="hardware", name="schema", node=schema_of(config.HardwareConfig))
    cs.store(group="engine", name="schema", node=schema_of(config.EngineConfig))
    cs.store(group="sampling", name="schema", node=schema_of(config.SamplingParams))
    cs.store(group="sparse", name="schema", node=schema_of(config.SparseConfig), package="engine.sparse")
    cs.store(group="tier", name="schema", node=schema_of(config.TierConfig), package="engine.tier")
    cs.store(group="serve", name="schema", node=schema_of(config.ServeConfig))
    _REGISTERED = True


def run_dir(name: str) -> str:
    """`<this run's Hydra output directory>/<name>`; outside a Hydra job (compose, tests), a fresh
    temporary directory: two runs never share (and so never clobber) a disk tier by default."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return os.path.join(HydraConfig.get().runtime.output_dir, name)
    except ValueError:  # no Hydra job is running
        return tempfile.mkdtemp(prefix=f"gemini_jax_{name}_")


def build(cls, node):
    """Frozen, validated config from a Hydra node."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(node, resolve=True) if not isinstance(node, dict) else node
    return config.from_dict(cls, data)


def one_line_errors(task):
    """Wrap a Hydra task function so that a typed error (gemini_jax.errors) or an OmegaConf
    validation error prints as one line, `ConfigError: <what is wrong>`, and exits with status 2,
    instead of a traceback whose last line is the message. HYDRA_FULL_ERROR=1 re-raises it whole."""
    from omegaconf.errors import OmegaConfBaseException

    from gemini_jax.errors import GeminiJaxError

    @functools.wraps(task)
    def wrapped(*args, **kwargs):
        try:
            return task(*args, **kwargs)
        except (GeminiJaxError, OmegaConfBaseException) as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            import sys

            print(f"{type(err).__name__}: {err}".splitlines()[0] if isinstance(err, OmegaConfBaseException)
                  else f"{type(err).__name__}: {err}", file=sys.stderr)
            print("(HYDRA_FULL_ERROR=1 for the full trace)", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapped
