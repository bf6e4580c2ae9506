"""`SelectionObserver`: research hooks on the sparse selection of the tiered store, given to the
engine once (`gj.Engine(model, config, observer=...)`), never set on the store mid-run.

    log = []
    eng = gj.Engine(model, cfg, observer=gj.SelectionObserver(log=log, edit=force_needle_pages))

`log` receives one record per layer and call: {"layer", "decode", "positions", "selected": logical
page ids [B, K, k]}. `edit(layer, decode, positions [B, T], selected [B, K, k]) -> selected` (same
shape: logical ids, ascending, -1 padded) replaces a selection before its pages are read, e.g. an
oracle that forces chosen pages in. With an `edit`, decode steps run layer by layer (the
one-program step selects on device, where no host function can change it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class SelectionObserver:
    log: Optional[list] = None
    edit: Optional[Callable] = None
