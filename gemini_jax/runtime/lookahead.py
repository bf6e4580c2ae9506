"""The prefetch lookahead over tiers: which layers a layer guesses for, with what selection, and the guess.

During a sparse decode step, layer l also scores layer l+depth's digests with a query built from
layer l's input (the residual stream changes little from layer to layer), so the pages that layer
will select can be fetched before it runs. Both tiered decode paths use these: the host layer loop
(`runtime/tiered.py`) and the one-program step (`runtime/fused.py`). A guess never changes numbers:
it only decides what is fetched early.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from gemini_jax.attention.select import select_step
from gemini_jax.attention.views import PageView
from gemini_jax.config import SparseConfig, TierConfig
from gemini_jax.runtime.batch import CallArrays


def selection(sp: SparseConfig, tc: TierConfig) -> Optional[SparseConfig]:
    """The lookahead's selection: the guess is rough, so it takes `tc.lookahead` x the budget;
    None when there is no lookahead (dense, no prefetch, or lookahead 0)."""
    if not sp.enabled or tc.prefetch_depth <= 0 or tc.lookahead <= 0:
        return None
    return dataclasses.replace(sp, budget=sp.budget * tc.lookahead)


def targets(layer: int, depth: int, num_layers: int, first: int = 0) -> tuple[int, ...]:
    """The layers `layer` guesses for: layer + depth; layer 0 also covers 1 .. depth - 1 (no earlier
    input exists in the step for them). Layers below `first` (dense layers) select nothing."""
    wanted = range(1, depth + 1) if layer == 0 else (layer + depth,)
    return tuple(j for j in wanted if first <= j < num_layers)


def guess(model, sp_ahead: SparseConfig, target: int, h, call: CallArrays, digests, *, block_size: int, window):
    """Layer `target`'s selection predicted from an earlier input `h`: its q projection of `h` at
    `call.positions`, scored against its digests (`digests` is that layer's; no length bound, so
    every page of the table is a candidate). -> page indices, as `select_step` returns them."""
    q, _, _ = model.layer_qkv(target, h, call.positions)
    return select_step(sp_ahead, digests, (q, call.positions), PageView(call.page_table), block_size=block_size,
                       window=window, inv_freq=call.unrope)
