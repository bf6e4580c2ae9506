"""The row registry: each benchmark row is a function `ctx -> RowResult`, registered by name.

To add a row: write `gemini_jax/bench/rows/<name>.py` with

    @row("my_row", about="one paragraph: what is compared, how it is timed")
    def my_row(ctx: Context) -> RowResult:
        sizes = ctx.pick(quick=dict(...), full=dict(...))
        ...
        return RowResult(records=[{...}, ...], markdown="table + notes")

and import it in `gemini_jax/bench/rows/__init__.py`. Records are flat dicts (they go to bench.json as
they are); the markdown is the row's section of BENCH.md (the heading is added for you).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RowResult:
    records: list[dict]
    markdown: str


@dataclass
class Context:
    """What every row sees: the run mode, the machine and its measured bandwidth, and a memo of
    measurements shared between rows (so `kv_bytes` reuses `paged_vs_contiguous`'s step times)."""

    quick: bool
    seed: int
    machine: dict
    bandwidth: dict  # from machine.measure_bandwidth; bandwidth["reference_gbs"] is the one to use
    memo: dict = field(default_factory=dict)

    def pick(self, *, quick: dict, full: dict) -> dict:
        return dict(quick if self.quick else full)

    def shared(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()` once per run under `key`; later rows get the same result."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


@dataclass(frozen=True)
class Row:
    name: str
    about: str
    fn: Callable[[Context], RowResult]


ROWS: dict[str, Row] = {}


def row(name: str, *, about: str):
    """Register `fn` as benchmark row `name`, in registration order (the report's order)."""

    def deco(fn):
        if name in ROWS:
            raise ValueError(f"benchmark row {name!r} is registered twice.")
        ROWS[name] = Row(name, about, fn)
        return fn

    return deco
