"""Study `exactness`: the logit errors behind the exactness invariants (docs/architecture.md §6), measured.

The tests assert tolerances; this study records the errors those tolerances hold. Everything runs in
fp32 on seeded random tiny models (every weight random, norms and biases included) and fresh seeded
random tokens. One row per (path, family):

    hf       our decoder, weights from transformers' `save_pretrained` read by `load_hf`, vs
             transformers' own forward: full-sequence logits                       (invariant 1)
    engine   the paged engine (chunked prefill, then decode steps) vs the full-sequence forward,
             teacher-forced on the engine's tokens                                 (invariant 2)
    sparse   sparse attention with a budget covering every page vs dense paged      (invariant 3)
    tiered   device slots for 25 % of the pages + host tier, prefetch depth 2 vs all-resident
                                                                                    (invariant 4)
    resume   interrupt after half the tokens, snapshot, resume in a second engine vs the
             uninterrupted run: the logits of the tokens after the resume point     (invariant 5)
    soft     soft tokens (seeded random vectors at the scale of the embedding table) in the
             middle of each prompt, through the paged engine, vs the full-sequence forward on
             embeddings (gemini_jax.encoders.forward_embeds), teacher-forced   (invariant 2)
    aligned  syntax-aligned pages (`cache.align=syntax`) with sparse attention at a budget covering
             every page, on prompts of held-out standard-library Python pieced from definitions' first
             lines (so pages are padded; a byte-vocabulary random model: alignment reads bytes), vs
             the full-sequence forward, teacher-forced                         (invariants 2, 3)

`max_abs_err` is max |ours - ref| over every compared logit; `max_rel_err` is that over max |ref|
(the relative error tests/test_weights.py asserts; per-element ratios blow up at logits near 0).
Where two generations pick different tokens (a float near-tie), logits are compared up to and
including the first differing step: later ones follow different contexts. transformers and torch
are optional (the `hf` extra): without them an hf row says so and carries no figure.
"""

from __future__ import annotations

import importlib
import re
import tempfile
from dataclasses import dataclass

import numpy as np

from gemini_jax import weights
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig, compat
from gemini_jax.engine import Engine
from gemini_jax.errors import ConfigError
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import as_tuple
from gemini_jax.model import forward
from gemini_jax.testing import FAMILIES, random_model, random_prompts, tiny_config

PATHS = ("hf", "engine", "sparse", "tiered", "resume", "soft", "aligned")
# Families without sliding windows (aligned pages refuse windows: they count tokens, not slots).
ALIGNED_FAMILIES = tuple(f for f in FAMILIES if not any(tiny_config(f).layer_windows))
BLOCK = 8   # tokens per KV page: the prompts span several pages and end inside one
CHUNK = 32  # prefill chunk: the prompts take several; a chunk writes 4-5 pages, which with the pinned
            # pages must fit the tiered path's device slots
GREEDY = dict(temperature=0.0, stop_at_eos=False)

# path -> (tolerance the test asserts, what it bounds, the test). The figures are the literals in
# those tests (tests/test_studies.py checks they still appear there).
TOLERANCES = {
    "hf": (1e-4, "max_rel_err", "tests/test_weights.py::test_hf_parity"),
    "engine": (1e-5, "max_abs_err / max(1, max|ref|)", "tests/test_engine.py::test_engine_matches_forward"),
    "sparse": (1e-5, "max_abs_err", "tests/test_sparse.py::test_budget_covering_context_equals_dense_paged"),
    "tiered": (1e-5, "max_abs_err", "tests/test_tiers_engine.py::test_budgets_and_prefetch_depths_keep_the_numbers"),
    # The resume tests compare tokens (a first difference must be a near-tie), not logits.
    "resume": (None, "tokens", "tests/test_session.py::test_resume_equals_fresh_run_50_cases"),
    "soft": (1e-5, "max_abs_err", "tests/test_prompt_images.py::test_image_prompt_reproduces_the_dense_reference"),
    "aligned": (1e-4, "max_abs_err", "tests/test_aligned_pages.py::test_aligned_pages_reproduce_the_dense_reference"),
}

# The transformers model per family, its quirks switched on as tests/test_weights.py does: windows
# shorter than the sequence, soft-caps, rope scaling. family -> (config class, model class, kwargs).
HF_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
HF_CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(attention_bias=True, rope_parameters=dict(
                  rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1000.0))),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=0.5,
                    query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=False, query_pre_attn_scalar=24,
                    rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                     "sliding_attention": dict(rope_type="default", rope_theta=100.0)})),
}


@dataclass(frozen=True, kw_only=True)
class Config:
    families: tuple[str, ...] = FAMILIES
    # The stateful paths cost about as much per family as the other three together: by default they
    # run on the families their tests run (llama, and gemma2 with its windows and soft-caps).
    tiered_families: tuple[str, ...] = ("llama", "gemma2")
    resume_families: tuple[str, ...] = ("llama", "gemma2")
    # Aligned pages need full-attention models (sliding windows count tokens, not slots).
    aligned_families: tuple[str, ...] = ("llama", "qwen3")
    aligned_lengths: tuple[int, ...] = (300, 700)  # bytes of code per prompt: a few definitions each
    paths: tuple[str, ...] = PATHS
    prompt_lengths: tuple[int, ...] = (60, 180)
    new_tokens: int = 12
    hf_length: int = 32
    seed: int = 0
    out_name: str = "exactness"

    def __post_init__(self):
        for field in ("families", "tiered_families", "resume_families", "aligned_families", "paths"):
            as_tuple(self, field, str)
        as_tuple(self, "prompt_lengths", int)
        as_tuple(self, "aligned_lengths", int)
        for field, allowed in (("families", FAMILIES), ("tiered_families", FAMILIES),
                               ("resume_families", FAMILIES), ("aligned_families", ALIGNED_FAMILIES),
                               ("paths", PATHS)):
            bad = [v for v in getattr(self, field) if v not in allowed]
            if bad:
                raise ConfigError(f"exactness {field} {bad} are not among {list(allowed)}.")
        if min(self.prompt_lengths) < 1:
            raise ConfigError(f"exactness prompt_lengths={list(self.prompt_lengths)} must all be >= 1.")
        if self.new_tokens < 2:
            raise ConfigError(f"exactness new_tokens={self.new_tokens} must be >= 2 (resume splits them in two).")
        if self.hf_length < 1:
            raise ConfigError(f"exactness hf_length={self.hf_length} must be >= 1.")


def run(cfg: Config) -> StudyResult:
    """One row per (path, family): hf, engine and sparse on `families`, tiered on `tiered_families`,
    resume on `resume_families`. Family f uses seed `seed + FAMILIES.index(f)` for its model and tokens."""
    on = {"tiered": cfg.tiered_families, "resume": cfg.resume_families, "aligned": cfg.aligned_families}
    rows = []
    for family in [f for f in FAMILIES if f in {*cfg.families, *cfg.tiered_families, *cfg.resume_families,
                                                 *cfg.aligned_families}]:
        seed = cfg.seed + FAMILIES.index(family)
        paths = [p for p in cfg.paths if family in on.get(p, cfg.families)]
        new = [_hf_row(family, seed, cfg.hf_length)] if "hf" in paths else []
        engine_paths = [p for p in paths if p != "hf"]
        if engine_paths:
            new += _engine_rows(family, seed, cfg, engine_paths)
        for row in new:
            print(f"{row['path']:7s} {row['family']:8s} abs {_fmt(row['max_abs_err'])} rel {_fmt(row['max_rel_err'])} "
                  f"within {row['within_tolerance']}", flush=True)
        rows += new
    return StudyResult(name=cfg.out_name, records=rows, split=None, seeds=[cfg.seed],
                       extra={"dtype": "float32", "versions": _versions(),
                              "all_within_tolerance": all(r["within_tolerance"] is not False for r in rows)})


# ---- rows -----------------------------------------------------------------------------------


def _row(path: str, family: str, seed: int, shape: str, errors: dict, **extra) -> dict:
    tol, on, test = TOLERANCES[path]
    return {"path": path, "family": family, **errors, "tolerance_asserted_in_tests": tol, "tolerance_on": on,
            "test": test, "seed": seed, "shape": shape, **extra}


def _errors(ours: list, refs: list) -> dict:
    """max_abs_err, max_rel_err and max |ref| (its `_scale` copy stays out of the row) over paired arrays."""
    ours_all = np.concatenate([np.asarray(o, np.float32).reshape(-1) for o in ours])
    ref_all = np.concatenate([np.asarray(r, np.float32).reshape(-1) for r in refs])
    abs_err = float(np.abs(ours_all - ref_all).max())
    scale = float(np.abs(ref_all).max())
    return {"max_abs_err": abs_err, "max_rel_err": abs_err / scale, "ref_max_abs": scale, "_scale": scale}


def _within(path: str, errs: dict) -> bool:
    tol, on, _ = TOLERANCES[path]
    bound = {"max_rel_err": tol * errs["_scale"], "max_abs_err": tol,
             "max_abs_err / max(1, max|ref|)": tol * max(1.0, errs["_scale"])}[on]
    return bool(np.isfinite(errs["max_abs_err"]) and errs["max_abs_err"] <= bound)


def _hf_row(family: str, seed: int, length: int) -> dict:
    """Full-sequence logits of our decoder vs transformers on the same checkpoint (batch 2)."""
    shape = f"f32[2, {length}, {HF_SIZES['vocab_size']}] (batch, tokens, vocab)"
    try:
        torch = importlib.import_module("torch")
        transformers = importlib.import_module("transformers")
    except ImportError:
        return _row("hf", family, seed, shape, {"max_abs_err": None, "max_rel_err": None},
                    within_tolerance=None, note="transformers not installed (pip install -e '.[hf]')")
    config_cls, model_cls, kwargs = HF_CASES[family]
    config = getattr(transformers, config_cls)(**HF_SIZES, **kwargs)
    config._attn_implementation = "eager"  # the reference math, not a fused kernel
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():  # norms, biases and embeddings all move off their init
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    tokens = np.random.default_rng(seed).integers(0, HF_SIZES["vocab_size"], (2, length))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model = weights.load_hf(tmp)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(tokens)).logits.float().numpy()
    ours = [np.asarray(forward(model, row)) for row in tokens]
    errs = _errors(ours, list(theirs))
    return _row("hf", family, seed, shape, _public(errs), within_tolerance=_within("hf", errs),
                note=f"transformers {transformers.__version__}, eager attention")


def _engine_config(cfg: Config, extra: int = 0, **over) -> EngineConfig:
    """The engines' config; `extra` tokens more than the longest prompt (soft tokens)."""
    max_len = -(-(max(cfg.prompt_lengths) + extra + cfg.new_tokens) // BLOCK) * BLOCK
    return EngineConfig(max_seq_len=max_len, max_batch=len(cfg.prompt_lengths), prefill_chunk=CHUNK,
                        cache=CacheConfig(block_size=BLOCK), **over)


def _engine_rows(family: str, seed: int, cfg: Config, paths: list) -> list:
    """Rows engine / sparse / tiered / resume on one random model and one set of random prompts."""
    model = random_model(tiny_config(family), seed)
    prompts = random_prompts(np.random.default_rng(seed), model.cfg.vocab_size, cfg.prompt_lengths)
    params = SamplingParams(max_new_tokens=cfg.new_tokens, **GREEDY)
    base = _engine_config(cfg)
    shape = (f"f32[{len(prompts)}, {cfg.new_tokens}, {model.cfg.vocab_size}] (prompts of "
             f"{'/'.join(map(str, cfg.prompt_lengths))} tokens, decode steps, vocab); block {BLOCK}, chunk {CHUNK}")
    dense = None
    if {"engine", "sparse", "tiered"} & set(paths):
        dense = Engine(model, base).generate(prompts, params, return_logits=True)
    rows = []
    if "engine" in paths:
        refs = [np.asarray(forward(model, p + t))[len(p) - 1: len(p) - 1 + len(t)]
                for p, t in zip(prompts, dense.tokens)]
        errs = _errors(dense.logits, refs)
        rows.append(_row("engine", family, seed, shape, _public(errs), within_tolerance=_within("engine", errs),
                         tokens_equal=None, note="reference teacher-forced on the engine's tokens"))
    if "sparse" in paths:
        sparse = SparseConfig(enabled=True, budget=base.max_seq_len, sparse_prefill=True)
        out = Engine(model, _engine_config(cfg, sparse=sparse)).generate(prompts, params, return_logits=True)
        rows.append(_compare_runs("sparse", family, seed, shape, out, dense,
                                  f"budget {base.max_seq_len} tokens = every page, sparse prefill"))
    if "tiered" in paths:
        tier = TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=2, hot_threshold=0)
        with Engine(model, _engine_config(cfg, tier=tier)) as eng:
            out = eng.generate(prompts, params, return_logits=True)
        rows.append(_compare_runs("tiered", family, seed, shape, out, dense,
                                  f"device 25 % of the pages, host tier unbounded, prefetch depth 2; "
                                  f"{out.stats['pages_fetched_host']} page fetches from host"))
    if "resume" in paths:
        rows.append(_resume_row(model, family, seed, prompts[0], cfg.new_tokens, base))
    if "soft" in paths:
        rows.append(_soft_row(model, family, seed, prompts, params, _engine_config(cfg, extra=SOFT_TOKENS)))
    if "aligned" in paths:
        rows.append(_aligned_row(family, seed, cfg, params))
    return rows



def _aligned_row(family: str, seed: int, cfg: Config, params) -> dict:
    """Windows of held-out Python starting at a definition, through syntax-aligned pages with sparse
    attention at a covering budget, vs the full-sequence forward teacher-forced on the engine's tokens."""
    from gemini_jax.eval.heldout import heldout_text  # the corpus loads only for this path
    from gemini_jax.runtime import aligned

    model = random_model(tiny_config(family, vocab_size=compat.BYTE_VOCAB), seed)
    hay = heldout_text().tobytes()
    rng = np.random.default_rng([seed, 259])
    starts = [m.start() + 1 for m in re.finditer(rb"\n(?:def|class) ", hay[:len(hay) - 256])]
    # Each prompt is pieces of 40-150 bytes, each from a top-level definition's first line: every piece
    # starts a definition at a byte that is rarely a page boundary, so the layout has padding to mask.
    prompts = []
    for n in cfg.aligned_lengths:
        text = b""
        while len(text) < n:
            s = int(rng.choice(starts))
            text += hay[s:s + int(rng.integers(40, 151))].rstrip(b"\n") + b"\n"
        prompts.append([int(b) for b in text[:n]])
    room = max(cfg.aligned_lengths) // 2  # padding slots: at most a page per definition
    max_len = -(-(max(cfg.aligned_lengths) + room + cfg.new_tokens) // BLOCK) * BLOCK
    config = EngineConfig(max_seq_len=max_len, max_batch=len(prompts), prefill_chunk=CHUNK,
                          cache=CacheConfig(block_size=BLOCK, align="syntax"),
                          sparse=SparseConfig(enabled=True, budget=max_len, sparse_prefill=True))
    pads = [int(np.sum(aligned.slot_tokens(config, p) == aligned.PAD)) for p in prompts]
    if not all(pads):  # a layout without padding would measure fixed pages again
        raise RuntimeError(f"exactness aligned path: a prompt's layout has no padding ({pads}); seed {seed}")
    with Engine(model, config) as eng:
        out = eng.generate(prompts, params, return_logits=True)
    refs = [np.asarray(forward(model, p + t))[len(p) - 1: len(p) - 1 + len(t)] for p, t in zip(prompts, out.tokens)]
    errs = _errors(out.logits, refs)
    shape = (f"f32[{len(prompts)}, {params.max_new_tokens}, {model.cfg.vocab_size}] (code prompts of "
             f"{'/'.join(map(str, cfg.aligned_lengths))} bytes, decode steps, vocab); block {BLOCK}, chunk {CHUNK}")
    return _row("aligned", family, seed, shape, _public(errs), within_tolerance=_within("aligned", errs),
                tokens_equal=None, note=f"sparse, budget {max_len} = every page, sparse prefill; "
                                        f"{'/'.join(map(str, pads))} padding slots; reference: forward, teacher-forced")


SOFT_TOKENS = 4  # soft tokens per prompt in the soft path


def _soft_row(model, family: str, seed: int, prompts: list, params, config: EngineConfig) -> dict:
    """Each prompt with SOFT_TOKENS random soft tokens in its middle, through the paged engine, vs
    the full-sequence forward on embeddings teacher-forced on the engine's tokens."""
    from gemini_jax.encoders import forward_embeds  # the encoders' stack loads only for this path

    rng = np.random.default_rng([seed, SOFT_TOKENS])
    scale = float(np.std(np.asarray(model.embed[...])))
    with Engine(model, config) as eng:
        mixed = []
        for i, p in enumerate(prompts):
            vec = (scale * rng.standard_normal((SOFT_TOKENS, model.cfg.hidden_size))).astype(np.float32)
            ids = eng.soft.add(f"exactness-{family}-{seed}-{i}", vec, {"encoder": "random", "seed": str(seed)})
            mid = len(p) // 2
            mixed.append((p[:mid], vec, p[mid:], [int(t) for t in ids]))
        out = eng.generate([a + ids + b for a, _, b, ids in mixed], params, return_logits=True)
    refs = []
    for (a, vec, b, _), gen in zip(mixed, out.tokens):
        emb = np.concatenate([np.asarray(model.embed_tokens(np.asarray(a, np.int32))), vec,
                              np.asarray(model.embed_tokens(np.asarray(b + gen, np.int32)))])
        start = len(a) + SOFT_TOKENS + len(b) - 1
        refs.append(np.asarray(forward_embeds(model, emb))[start:start + len(gen)])
    errs = _errors(out.logits, refs)
    shape = (f"f32[{len(prompts)}, {params.max_new_tokens}, {model.cfg.vocab_size}] (prompts of "
             f"{'/'.join(str(len(p) + SOFT_TOKENS) for p in prompts)} tokens with {SOFT_TOKENS} soft ones in the "
             f"middle, decode steps, vocab); block {BLOCK}, chunk {CHUNK}")
    return _row("soft", family, seed, shape, _public(errs), within_tolerance=_within("soft", errs),
                tokens_equal=None, note="paged engine; reference: forward on embeddings, teacher-forced")


def _compare_runs(path: str, family: str, seed: int, shape: str, out, ref, note: str) -> dict:
    ours, refs = [], []
    for toks, lg, ref_toks, ref_lg in zip(out.tokens, out.logits, ref.tokens, ref.logits):
        n = _comparable_steps(toks, ref_toks)
        ours.append(lg[:n])
        refs.append(ref_lg[:n])
    errs = _errors(ours, refs)
    return _row(path, family, seed, shape, _public(errs), within_tolerance=_within(path, errs),
                tokens_equal=out.tokens == ref.tokens, note=note)


def _resume_row(model, family: str, seed: int, prompt: list, n: int, config: EngineConfig) -> dict:
    """Uninterrupted session vs one interrupted after n // 2 tokens, snapshotted, and resumed (no
    instruction) in a second engine; the logits each later token is chosen from."""
    t = n // 2
    params = SamplingParams(max_new_tokens=n, **GREEDY)
    eng = Engine(model, config)
    whole = eng.start(prompt, params)
    ref_toks, ref_lg = _drain(whole, n)
    whole.close()
    cut = eng.start(prompt, params)
    first, _ = _drain(cut, t)
    cut.interrupt()
    with tempfile.TemporaryDirectory() as tmp:
        cut.snapshot(f"{tmp}/snap")
        cut.close()
        resumed = Engine(model, config).resume(f"{tmp}/snap", [], params=SamplingParams(max_new_tokens=n - t, **GREEDY))
        toks, lg = _drain(resumed, n - t)
        resumed.close()
    steps = _comparable_steps(toks, ref_toks[t:])
    errs = _errors([lg[:steps]], [ref_lg[t:t + steps]])
    shape = (f"f32[{n - t}, {model.cfg.vocab_size}] (decode steps after the resume point, vocab); prompt of "
             f"{len(prompt)} tokens, interrupted after {t} of {n}; block {BLOCK}, chunk {CHUNK}")
    equal = first + toks == ref_toks
    return _row("resume", family, seed, shape, _public(errs), within_tolerance=equal, tokens_equal=equal,
                note="snapshot restored in a second engine; tests assert tokens, not logits")


def _drain(sess, n: int) -> tuple[list, np.ndarray]:
    """Up to n tokens from a session and the logits each was chosen from (f32[n, vocab])."""
    toks, logits = [], []
    for _ in range(n):
        logits.append(np.asarray(sess.logits)[0])
        toks.append(next(sess))
    return toks, np.stack(logits)


def _comparable_steps(ours: list, ref: list) -> int:
    """Steps whose logits follow the same tokens: up to and including the first that differs."""
    diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    return min(len(ours), len(ref)) if diff is None else diff + 1


def _public(errs: dict) -> dict:
    return {k: v for k, v in errs.items() if not k.startswith("_")}


def _versions() -> dict:
    out = {}
    for name in ("jax", "torch", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.2e}"


def markdown(record: dict) -> str:
    lines = ["# Exactness: measured logit errors", "",
             f"Run {record['date']}, command `{record['command']}`, commit {record['commit']}. fp32; seeded random "
             f"tiny models (every weight random) and random tokens; "
             f"{', '.join(f'{k} {v or chr(8212)}' for k, v in record['versions'].items())}. "
             "`max rel` is max |ours − ref| / max |ref|. `tolerance` is what the named test asserts, on the "
             "quantity after it; resume is asserted on tokens only.", "",
             "| path | family | max abs err | max rel err | tolerance (asserted on) | within | seed | shape | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in record["records"]:
        tol = "tokens" if r["tolerance_asserted_in_tests"] is None else \
            f"{r['tolerance_asserted_in_tests']:g} ({r['tolerance_on']})"
        within = {True: "✓", False: "✗ FAIL", None: "—"}[r["within_tolerance"]]
        cells = [r["path"], r["family"], _fmt(r["max_abs_err"]), _fmt(r["max_rel_err"]), tol, within, r["seed"],
                 r["shape"], r.get("note", "")]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")  # `|ref|` stays in its cell
    lines += ["", f"All within the tests' tolerances: {'yes' if record['all_within_tolerance'] else 'NO'}."]
    return "\n".join(lines) + "\n"
