"""Which features combine: one table, checked in one place.

Each row refuses one combination of settings from different concerns (cache x sparse x tier x
mesh x attention path), or of a setting with the model or with a use of the engine. The rows are
checked here and nowhere else: `EngineConfig` checks `ENGINE` when it is built, `Engine` checks
`MODEL` once with the model it is given, and sessions and the server check their `USES` row. A
value wrong on its own (a negative budget) is refused by its own config, a size that does not fit
(a budget over the pool) by `EngineConfig`.

docs/knobs.md shows the table (`python experiments/knobs.py` renders it from `ROWS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gemini_jax.errors import ConfigError

BYTE_VOCAB = 259  # the byte-level tokenizer's vocabulary: bytes 0..255, BOS, EOS, PAD


@dataclass(frozen=True)
class Rule:
    """`feature` does not run without `needs`; `refuses(...)` says a config asks for that anyway and
    `message(...)` says so in one line that names the setting and what to set instead."""

    feature: str
    needs: str
    refuses: Callable[..., bool]
    message: Callable[..., str]


def _align_without(what: str, ok: Callable) -> Rule:
    return Rule("cache.align='syntax'", what, lambda e: e.cache.align != "none" and not ok(e),
                lambda e: f"cache.align={e.cache.align!r} does not run with {_named(what, e)}; set "
                          f"cache.align='none' for it.")


def _named(what: str, e) -> str:
    # The message names the value the config holds where the row is about one field.
    if what.startswith("attention_impl"):
        return f"attention_impl={e.attention_impl!r} (use 'xla')"
    if what.startswith("sparse.positions"):
        return f"sparse.positions={e.sparse.positions!r} (use 'true')"
    return {"tier.enabled=false": "tier.enabled", "one device": "a device mesh"}[what]


# Rows on the engine config alone (padding slots are masked on the XLA path of the all-resident
# pool; the kernels, the tiers' layer-by-layer runner and a mesh do not carry page fills).
ENGINE: tuple[Rule, ...] = (
    Rule("sparse.enabled", "cache.kind='paged'", lambda e: e.sparse.enabled and e.cache.kind != "paged",
         lambda e: f"sparse.enabled needs cache.kind='paged' (got {e.cache.kind!r})."),
    _align_without("attention_impl='xla'", lambda e: e.attention_impl == "xla"),
    _align_without("tier.enabled=false", lambda e: not e.tier.enabled),
    _align_without("one device", lambda e: e.mesh.devices == 1),
    _align_without("sparse.positions='true'", lambda e: not e.sparse.enabled or e.sparse.positions == "true"),
    Rule("tier.enabled", "cache.kind='paged'", lambda e: e.tier.enabled and e.cache.kind != "paged",
         lambda e: f"tier.enabled needs cache.kind='paged' (got {e.cache.kind!r})."),
    Rule("tier.enabled", "attention_impl='xla'", lambda e: e.tier.enabled and e.attention_impl != "xla",
         lambda e: f"tier.enabled runs attention layer by layer on the XLA path; set attention_impl='xla' "
                   f"(got {e.attention_impl!r})."),
    Rule("tier.enabled", "sparse.rerank=0 (rerank reads candidate pages that may not be on device)",
         lambda e: e.tier.enabled and e.sparse.enabled and e.sparse.rerank > 0,
         lambda e: f"sparse.rerank={e.sparse.rerank} reads the keys of candidate pages before it selects; over "
                   f"tiers those pages may not be on device. Set sparse.rerank=0 or tier.enabled=false."),
    Rule("tier.persistent", "cache.kind='paged'", lambda e: e.tier.persistent and e.cache.kind != "paged",
         lambda e: "tier.persistent stores pages: it needs the paged cache (cache.kind='paged')."),
    Rule("mesh over more than one device", "cache.kind='paged'",
         lambda e: e.mesh.devices > 1 and e.cache.kind != "paged",
         lambda e: "a device mesh needs the paged cache (cache.kind='paged')."),
)

# Rows on the engine config with the model's config.
MODEL: tuple[Rule, ...] = (
    Rule("cache.align='syntax'", f"a byte-level model (vocabulary {BYTE_VOCAB})",
         lambda e, m: e.cache.align != "none" and m.vocab_size != BYTE_VOCAB,
         lambda e, m: f"cache.align={e.cache.align!r} reads the prompt's token ids as bytes: it needs a byte-level "
                      f"model (vocabulary {BYTE_VOCAB}), not one of {m.vocab_size} tokens."),
    Rule("cache.align='syntax'", "a full-attention model (no sliding-window layers)",
         lambda e, m: e.cache.align != "none" and any(w > 0 for w in m.layer_windows),
         lambda e, m: f"cache.align={e.cache.align!r}: this model has sliding-window layers, whose windows count "
                      f"tokens, not slots; aligned pages need a full-attention model."),
    Rule("sparse.positions='compact'", "a model with one rope (no local rope, as Gemma 3 has)",
         lambda e, m: e.sparse.enabled and e.sparse.positions == "compact" and m.local_rope is not None,
         lambda e, m: "sparse.positions='compact' re-rotates keys with the model's rope; this family has "
                      "a second (local) rope, which is not supported: use positions='true'."),
)

# Rows on a use of the engine: a `Session` (start / resume) and the server's scheduler.
USES: dict[str, tuple[Rule, ...]] = {
    "sessions": (
        Rule("sessions (interrupt, snapshot, resume)", "cache.kind='paged'", lambda e: e.cache.kind != "paged",
             lambda e: "sessions need the paged cache (EngineConfig.cache.kind='paged')."),
        Rule("sessions (interrupt, snapshot, resume)", "cache.align='none'", lambda e: e.cache.align != "none",
             lambda e: f"sessions (interrupt, snapshot, resume) do not run with cache.align={e.cache.align!r} "
                       f"yet; use generate / score, or cache.align='none'."),
    ),
    "serving": (
        Rule("serving", "cache.kind='paged'", lambda e: e.cache.kind != "paged",
             lambda e: "serving needs the paged cache (EngineConfig.cache.kind='paged')."),
        Rule("serving", "cache.align='none' (batches join and leave mid-prompt)", lambda e: e.cache.align != "none",
             lambda e: f"serving does not run with cache.align={e.cache.align!r} yet (its batches join and leave "
                       f"mid-prompt); use cache.align='none'."),
    ),
}

ROWS: tuple[tuple[str, Rule], ...] = (*(("engine config", r) for r in ENGINE), *(("with the model", r) for r in MODEL),
                                      *((use, r) for use, rules in USES.items() for r in rules))


def _first(rules, *args) -> None:
    for rule in rules:
        if rule.refuses(*args):
            raise ConfigError(rule.message(*args))


def check(engine_cfg) -> None:
    """ConfigError for the first `ENGINE` row this engine config breaks."""
    _first(ENGINE, engine_cfg)


def check_model(engine_cfg, model_cfg) -> None:
    """ConfigError for the first `MODEL` row this engine config breaks with this model."""
    _first(MODEL, engine_cfg, model_cfg)


def check_use(use: str, engine_cfg, where: str = "") -> None:
    """ConfigError for the first row of `USES[use]` this engine config breaks; `where` prefixes the
    message (e.g. "Engine.start: ")."""
    for rule in USES[use]:
        if rule.refuses(engine_cfg):
            raise ConfigError(where + rule.message(engine_cfg))
