"""Chunk-sparse attention over KV pages (`SparseConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from gemini_jax.config.base import is_int, require
from gemini_jax.config.model import DTYPES, Dtype

DigestKind = Literal["minmax", "mean"]
GroupReduce = Literal["max", "mean"]
BudgetMode = Literal["fixed", "topp"]
Positions = Literal["true", "compact"]
DIGEST_KINDS = get_args(DigestKind)
GROUP_REDUCE = get_args(GroupReduce)
BUDGET_MODES = get_args(BudgetMode)


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Chunk-sparse attention over KV pages (needs the paged cache).

    Each page keeps a digest per kv head: "minmax" (Quest: per-dimension key bounds, the score is
    an upper bound of q.k) or "mean" (the page's mean key). A decode step scores every page from
    its digest, keeps the first `sink_pages` and the last `local_pages` (the current page
    included) and fills `budget` tokens with the top-scoring rest. Query heads of a GQA group
    share one selection; `group_reduce` combines their scores. The first `dense_layers` layers
    attend to every page. `sparse_prefill` applies the same selection to prefill chunks (the
    chunk's own pages are always kept). When the budget covers the whole context every page is
    selected, so short contexts are never approximated.

    `positions`: "true" keeps every key at its own position; "compact" (InfLLM-style length
    extrapolation) re-positions the selected pages as if they were contiguous, ending at the query,
    so every query-key distance stays within about `budget` tokens, the span a model trained on
    short contexts knows (keys are re-rotated by the position change; the local pages keep their
    true distances). Identical to "true" while the budget covers the context.
    `score_queries`: how many of a sparse prefill chunk's queries score the pages (the last n real
    ones, padding excluded; 0 = all). Scoring costs chunk x pages x head_dim per chunk, which
    dominates at 10^6 tokens.
    `last_token_alone` (sparse prefill only): the prompt's last token runs as a call of its own, so
    the query whose logits give the first generated token selects its pages itself instead of
    sharing a chunk's selection (one small extra call per prompt; the chunk's queries, scoring
    together, often miss a page only that query needs).
    `score_distance` (compact positions only; 0 = off): score every page as if it sat that many
    tokens before the query, from digests of the keys before rope. Compact positions attend to a
    page at its re-positioned distance (within the budget), so scoring it at its true distance, far
    beyond what a short-context model was trained on, misjudges it.
    `rerank` (0 = off; n >= 2): two-stage selection. The digests pick n times as many candidate
    pages as the budget holds; the keys of the candidates are read and their exact scores (the
    largest q.k over the page's keys, the same queries, heads and distance as the digest scores)
    pick the pages to attend. Digest bounds are loose; exact scores are not, at the price of reading
    the candidates' keys (counted in `kv_bytes_read`). Paged cache only (not over tiers).
    `budget_mode`: "fixed" reads `budget` tokens per (sequence, kv head, layer); "topp" (adaptive,
    Twilight-style) reads, per (sequence, kv head, layer), the best pages until their share of the
    softmax of page scores (digest scores, or exact ones under rerank, at 1 / sqrt(head_dim))
    reaches `top_p`, never fewer than `min_budget` tokens nor more than `budget` (sink and local
    pages always). A peaked score distribution reads a few pages, a flat one the whole budget.
    """

    enabled: bool = False
    digest: DigestKind = "minmax"
    budget: int = 2048  # tokens of KV read per (sequence, kv head, layer), sink and local included
    sink_pages: int = 1
    local_pages: int = 2
    group_reduce: GroupReduce = "max"
    dense_layers: int = 0
    digest_dtype: Optional[Dtype] = None  # None: the cache dtype
    sparse_prefill: bool = False
    positions: Positions = "true"
    score_queries: int = 0
    last_token_alone: bool = True
    score_distance: int = 0
    rerank: int = 0
    budget_mode: BudgetMode = "fixed"
    top_p: float = 0.9
    min_budget: int = 0  # tokens (topp only); sink and local pages come on top

    def __post_init__(self):
        require(self.positions in get_args(Positions),
                 f"sparse.positions={self.positions!r} must be 'true' or 'compact'.")
        require(isinstance(self.score_queries, int) and self.score_queries >= 0,
                 f"sparse.score_queries={self.score_queries!r} must be an integer >= 0 (0 = every query).")
        require(isinstance(self.score_distance, int) and self.score_distance >= 0,
                 f"sparse.score_distance={self.score_distance!r} must be an integer >= 0 (0 = true positions).")
        require(self.score_distance == 0 or self.positions == "compact",
                 f"sparse.score_distance={self.score_distance} scores pages at the distance compact positions "
                 f"put them; it needs sparse.positions='compact' (got {self.positions!r}).")
        require(is_int(self.rerank) and (self.rerank == 0 or self.rerank >= 2),
                 f"sparse.rerank={self.rerank!r} must be 0 (off) or an integer >= 2 (candidate pages per "
                 f"selected page).")
        require(isinstance(self.last_token_alone, bool),
                 f"sparse.last_token_alone={self.last_token_alone!r} must be true or false.")
        require(self.digest in DIGEST_KINDS, f"sparse.digest={self.digest!r} must be one of {DIGEST_KINDS}.")
        require(self.group_reduce in GROUP_REDUCE,
                 f"sparse.group_reduce={self.group_reduce!r} must be one of {GROUP_REDUCE}.")
        for name in ("sink_pages", "local_pages", "dense_layers"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 0, f"sparse.{name}={v!r} must be an integer >= 0.")
        require(self.local_pages >= 1, f"sparse.local_pages={self.local_pages} must be >= 1 (the current page).")
        require(isinstance(self.budget, int) and self.budget > 0, f"sparse.budget={self.budget!r} must be > 0.")
        require(self.digest_dtype is None or self.digest_dtype in DTYPES,
                 f"sparse.digest_dtype={self.digest_dtype!r} must be None or one of {DTYPES}.")
        require(self.budget_mode in BUDGET_MODES,
                 f"sparse.budget_mode={self.budget_mode!r} must be one of {BUDGET_MODES}.")
        require(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1,
                 f"sparse.top_p={self.top_p!r} must be in (0, 1] (the share of score mass the pages read cover).")
        require(is_int(self.min_budget) and 0 <= self.min_budget <= self.budget,
                 f"sparse.min_budget={self.min_budget!r} must be an integer in [0, sparse.budget={self.budget}].")

