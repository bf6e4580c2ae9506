"""Syntax-aligned pages (`cache.align="syntax"`): a new KV page at each top-level definition.

A prompt is laid out in *slots*: its tokens in order, with `PAD` slots inserted before each top-level
definition (`gemini_jax.code.boundaries`) that does not already start a page, up to the next page
boundary. The page manager keeps slot tokens (pads included), so a page's hash covers its layout and
pages are shared only between equal layouts. The device sees three things per call: the tokens (a pad
runs as token 0, its K/V written into its own slot), their slots (where K/V go; masks compare slots,
whose order is the tokens' order) and their positions (rope: a token's index among real tokens, so
the numbers are those of fixed pages). Each logical page carries its fill (`PageView.fill`): slots
past it are padding, masked by attention, digests and selection.

Generated tokens and appended text are not aligned (they follow the last slot); decoding runs one
step per call (the multi-step program does not carry fills).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gemini_jax.config import EngineConfig
from gemini_jax.errors import ContextLengthError
from gemini_jax.runtime.batch import StepBatch
from gemini_jax.runtime.paged import PooledRunner

PAD = -1  # a padding slot in a sequence's slot tokens (never a token id: ids are >= 0)
def check_language(config: EngineConfig) -> None:
    """ConfigError unless `cache.align` names a known language (the model's side is
    `gemini_jax.config.compat.MODEL`)."""
    c = config.cache
    if c.align == "none":
        return
    from gemini_jax.code import language_spec  # tree-sitter loads only when pages are aligned

    language_spec(c.align_language)  # ConfigError naming the supported languages


def slot_tokens(config: EngineConfig, toks) -> np.ndarray:
    """The prompt's slot layout i32[n_slots]: `toks` with PAD slots before every top-level definition
    that does not start a page (`config.cache.align_language`; ids past the bytes read as line
    breaks). Without alignment, `toks` itself."""
    toks = np.asarray(toks, np.int32)
    c = config.cache
    if c.align == "none" or len(toks) == 0:
        return toks
    from gemini_jax.code.boundaries import definition_starts

    data = bytes(int(t) if 0 <= t < 256 else 10 for t in toks)  # one byte per token: offsets are indices
    S = c.block_size
    out, slot, prev = [], 0, 0
    for start in definition_starts(data, c.align_language, c.align_depth):
        piece = toks[prev:start]
        out.append(piece)
        slot += len(piece)
        if slot % S and start > 0:
            gap = S - slot % S
            out.append(np.full(gap, PAD, np.int32))
            slot += gap
        prev = start
    out.append(toks[prev:])
    return np.concatenate(out).astype(np.int32)


def check_length(config: EngineConfig, slots: np.ndarray, real: int, max_new: int) -> None:
    """ContextLengthError when the prompt's slots and `max_new` tokens overflow max_seq_len."""
    need = len(slots) + max_new
    if need > config.max_seq_len:
        raise ContextLengthError(
            f"the prompt's {real} tokens take {len(slots)} slots with syntax-aligned pages "
            f"({len(slots) - real} padding) + max_new_tokens={max_new} = {need} > EngineConfig.max_seq_len="
            f"{config.max_seq_len}; raise max_seq_len, shorten the prompt or set cache.align='none'.")


def page_fill(slots, block_size: int, width: int) -> np.ndarray:
    """i32[width]: slots of each logical page before its first PAD (block_size: none)."""
    t = np.asarray(slots)
    W = -(-len(t) // block_size)
    pad = np.zeros(W * block_size, bool)
    pad[:len(t)] = t == PAD
    pad = pad.reshape(W, block_size)
    out = np.full(width, block_size, np.int32)
    out[:W] = np.where(pad.any(axis=1), pad.argmax(axis=1), block_size)[:width]
    return out


def rope_positions(slots, first: int) -> np.ndarray:
    """Positions of slot tokens `slots` whose first real token sits at position `first`: each token
    its index among real tokens (a PAD takes the next real token's, unused)."""
    real = (np.asarray(slots) != PAD).astype(np.int32)
    return (first + np.cumsum(real) - real).astype(np.int32)


class AlignedRunner(PooledRunner):
    """`PooledRunner` over syntax-aligned pages (see the module's docstring)."""

    multistep = False

    def __init__(self, ctx, batch, stats):
        super().__init__(ctx, batch, stats)
        # sid -> fills of its pages (i32[pages_per_seq]). Pads sit only in prompts: decode steps
        # append no pads, so a row's fills change only when a prefill piece adds slots.
        self._fills: dict[int, np.ndarray] = {}

    def prefill(self, row, toks):
        sid = self.ids[row]
        slots = slot_tokens(self.ctx.config, toks)
        check_length(self.ctx.config, slots, len(toks), 0)
        reused = self.add(sid, slots)
        return self._prefill_from(sid, slots, reused)

    def _piece_batch(self, sid, padded, positions, n) -> StepBatch:
        have = self.ctx.pages.seqs[sid].tokens
        first = len(have) - have.count(PAD)
        cfg = self.ctx.config
        self._fills[sid] = page_fill(have + [int(t) for t in padded[:n]], cfg.cache.block_size, cfg.pages_per_seq)
        batch = StepBatch.prefill(sid, np.where(padded == PAD, 0, padded).astype(np.int32), positions, n)
        return dataclasses.replace(batch, rope=rope_positions(padded, first)[None], fill=self._fills[sid][None])

    def _decode_batch(self, ids, nxt, lengths) -> StepBatch:
        cfg = self.ctx.config
        slots = np.array([len(self.ctx.pages.seqs[s].tokens) for s in ids], np.int32)
        if int(slots.max()) >= cfg.max_seq_len:
            raise ContextLengthError(f"decoding past EngineConfig.max_seq_len={cfg.max_seq_len} slots "
                                     f"(syntax-aligned pages count their padding); raise max_seq_len.")
        fill = np.stack([self._fills.get(s, np.full(cfg.pages_per_seq, cfg.cache.block_size, np.int32)) for s in ids])
        return dataclasses.replace(StepBatch.decode_step(ids, nxt, slots),
                                   rope=np.asarray(lengths, np.int32)[:, None], fill=fill)
