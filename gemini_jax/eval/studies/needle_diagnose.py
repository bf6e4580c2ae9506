"""Study `needle_diagnose`: why a sparse needle answer fails. Was the needle's page selected, layer by
layer, at each answer step?

Each trial decodes the 5-digit key greedily through the engine over tiers with every page on device
(exact: the all-resident numbers), with the tiers' selection log on. For each answer step, each
layer and each kv head it records whether the selection held a page of the needle: for the shipped
byte model the pages of its key (the marker byte and the digits); for a pretrained chat model
(`model=<name>`, `gj.list_pretrained()`) the pages of the needle's line in its chat prompt
(`gemini_jax.data.chat.chat_needle_example`), its answer read as the needle study reads it. The
markdown gives accuracy, the needle-page recall per layer (first answer step and all steps), recall
in right vs wrong trials, and each wrong answer against its key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.data import chat, tasks
from gemini_jax.errors import ConfigError
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.needle import CHAT_ANSWER_TOKENS, is_correct
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import as_tuple, choice
from gemini_jax.eval.trials import Draw


@dataclass(frozen=True, kw_only=True)
class Config:
    lengths: tuple[int, ...] = (8192, 16384)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    trials: int = 2
    budget: int = 1024
    digest: str = "minmax"
    positions: str = "compact"
    block_size: int = 16
    chunk: int = 1024
    seed: int = 0
    oracle: str = "off"
    oracle_layers: tuple[int, ...] | None = None
    out_name: str | None = None
    model: str = "tiny"           # tiny (the shipped byte model) | a pretrained chat model's name
    sparse_prefill: bool = True   # False: the prompt attends densely, only decode steps select pages
    split: str = "dev"
    # Chat models: the main job's resumed conversation. The prompt goes on with an interrupted answer
    # ("The pass key", closed by the template) and a new user turn saying this; None: the question alone.
    resume_instruction: str | None = None

    def __post_init__(self):
        as_tuple(self, "lengths", int)
        as_tuple(self, "depths", float)
        as_tuple(self, "oracle_layers", int)
        choice(self, "digest", ("minmax", "mean"))
        choice(self, "positions", ("true", "compact"))
        choice(self, "oracle", ("off", "prompt", "decode", "all"))
        choice(self, "split", ("dev", "test"))
        choice(self, "model", ("tiny", *gj.list_pretrained()))
        if self.resume_instruction is not None and self.model == "tiny":
            raise ConfigError("resume_instruction needs a chat model (experiment.model=<name>), "
                              "not the byte model: it is a new turn through the chat template")

    @property
    def stem(self) -> str:
        model = "" if self.model == "tiny" else f"{self.model}_"
        return self.out_name or f"needle_diagnosis_{model}{self.positions}_{self.digest}_{self.budget}"


def needle_pages(ex, block_size: int) -> set[int]:
    """Logical pages holding the needle's marker byte and key digits."""
    mark = ex.needle_at + len(tasks.NEEDLE.split(tasks.MARK)[0].format(of=""))  # needle text starts at needle_at
    assert ex.prompt[mark] == ord(tasks.MARK), "needle layout changed"
    return {p // block_size for p in range(mark, mark + 1 + tasks.KEY_DIGITS)}


def chat_needle_pages(ex, tok, block_size: int) -> set[int]:
    """Logical pages holding the needle's line of a chat prompt (its tokens from `needle_at`: the key
    sits twice in the line, and a BPE splits digits over several tokens)."""
    n = len(tok.encode(chat.NEEDLE.format(key=ex.answer)))
    return {p // block_size for p in range(ex.needle_at, min(ex.needle_at + n, len(ex.prompt)))}


INTERRUPTED = "The pass key"  # the main job's answer when it is interrupted (3 tokens, seed 0)


@dataclass(frozen=True)
class ForcePages:
    """Oracle selection edit, the tiers' `selection_edit(layer, decode, positions, selected)` hook:
    every (sequence, kv head) row also reads `pages` (those already written), each in place of the
    row's earliest retrieved page (after the sink pages) or of padding, so the number of pages read
    stays the same. `when` is "prompt", "decode" or "all"; `layers` None edits every layer.
    `pages` is the running trial's set, updated in place between trials."""

    pages: set
    when: str
    layers: list | None
    sink_pages: int
    block_size: int

    def __call__(self, layer, decode, positions, selected):  # selected: i32[B, K, k], -1 = padding
        pages, layers = self.pages, self.layers
        if (self.when == "decode" and not decode) or (self.when == "prompt" and decode) or (
                layers and layer not in layers):
            return selected
        last = int(np.max(positions)) // self.block_size
        want = [p for p in sorted(pages) if p <= last]
        out = selected.copy()
        for row in out.reshape(-1, out.shape[-1]):
            _force_row(row, want, pages, self.sink_pages)
        return out


def _force_row(row, want, pages, sink_pages) -> None:
    """Put each page of `want` into `row` (in place): into padding first, else in place of the
    earliest retrieved page after the sink pages that is not one of `pages`; then re-sort."""
    have = set(row[row >= 0].tolist())
    for p in want:
        if p in have:
            continue
        free = np.flatnonzero(row < 0)
        spare = [c for c in range(sink_pages, len(row)) if row[c] >= 0 and row[c] not in pages]
        col = int(free[0]) if len(free) else (spare[0] if spare else None)
        if col is None:
            break
        have.discard(int(row[col]))
        row[col] = p
        have.add(p)
    row[:] = sorted(row, key=lambda x: (x < 0, x))


def run(cfg: Config) -> StudyResult:
    """Trial t at (length i, depth j) draws its haystack window and key from seed [seed, i, j, t]
    of the config's split."""
    model, tok = (gj.load_tiny(), None) if cfg.model == "tiny" else gj.load_pretrained(cfg.model)
    mcfg = model.cfg
    held = heldout_text()
    sp = SparseConfig(enabled=True, budget=cfg.budget, digest=cfg.digest, sink_pages=1, local_pages=2,
                      sparse_prefill=cfg.sparse_prefill, score_queries=64, positions=cfg.positions)
    tier = TierConfig(enabled=True, device_fraction=1.0, prefetch_depth=0)
    answer_len = tasks.KEY_DIGITS + 1 if tok is None else CHAT_ANSWER_TOKENS
    turn = [] if cfg.resume_instruction is None else \
        tok.encode(INTERRUPTED) + chat.chat_continuation(tok, cfg.resume_instruction)
    ecfg = EngineConfig(max_seq_len=max(cfg.lengths) + len(turn) + answer_len + 16, max_batch=1, prefill_chunk=cfg.chunk,
                        cache=CacheConfig(block_size=cfg.block_size, prefix_caching=False), sparse=sp, tier=tier)
    # The byte model has no EOS of its own; a chat model's answer ends at its end-of-turn token.
    params = SamplingParams(max_new_tokens=answer_len, temperature=0.0, stop_at_eos=tok is not None)
    layers = list(cfg.oracle_layers) if cfg.oracle_layers else None
    trials = []
    log: list = []
    forced: set = set()  # the running trial's needle pages, for the oracle
    edit = None if cfg.oracle == "off" else ForcePages(forced, when=cfg.oracle, layers=layers,
                                                       sink_pages=sp.sink_pages, block_size=cfg.block_size)
    with gj.Engine(model, ecfg, observer=gj.SelectionObserver(log=log, edit=edit)) as eng:
        cells = [(i, L, j, d, t) for i, L in enumerate(cfg.lengths) for j, d in enumerate(cfg.depths)
                 for t in range(cfg.trials)]
        for i, L, j, d, t in tqdm(cells, desc="needle diagnosis", unit="trial"):
            rng = Draw(cfg.split, cfg.seed).rng(i, j, t)
            if tok is None:
                ex = tasks.needle_example(held, L, d, rng)
                pages = needle_pages(ex, cfg.block_size)
            else:
                ex = chat.chat_needle_example(held, tok, L, d, rng)
                pages = chat_needle_pages(ex, tok, cfg.block_size)
            forced.clear()
            forced.update(pages)
            log.clear()
            out = eng.generate(list(map(int, ex.prompt)) + turn, params)
            if tok is None:
                text = bytes(x for x in out.tokens if x < 256).decode("utf-8", "replace")
                correct = is_correct(text, ex.answer)
            else:
                text = tok.decode(out.tokens)
                correct = chat.chat_answer_correct(text, ex.answer)
            # Answer steps: the prompt's last call (its last query gives the first answer digit), then decode.
            # Under dense prefill the prompt's calls select nothing and log nothing: decode steps only.
            steps = [r for r in log if not r["decode"]][-mcfg.num_layers:] + [r for r in log if r["decode"]]
            # hit[s, layer, head]: the selection of answer step s held a needle page
            hit = np.zeros((len(steps) // mcfg.num_layers, mcfg.num_layers, mcfg.num_kv_heads), bool)
            for n, r in enumerate(steps):
                sel = r["selected"][0]  # [K, k]
                for h in range(sel.shape[0]):
                    hit[n // mcfg.num_layers, r["layer"], h] = bool(pages & set(sel[h].tolist()))
            trials.append({"length": L, "depth": d, "trial": t, "key": ex.answer, "answer": text,
                           "correct": correct, "needle_pages": sorted(pages),
                           "hit": hit.tolist()})
    return StudyResult(name=cfg.stem, records=trials, split=cfg.split, seeds=[cfg.seed],
                       extra={"num_layers": mcfg.num_layers, "num_kv_heads": mcfg.num_kv_heads,
                              "model": "The shipped tiny model" if tok is None else cfg.model})


def _recall(trials, first_only: bool):
    """Mean over trials of the fraction of (step, head) selections holding a needle page, per layer."""
    rows = []
    for tr in trials:
        h = np.asarray(tr["hit"], float)  # [steps, layers, heads]
        h = h[:1] if first_only else h
        rows.append(h.mean(axis=(0, 2)))
    return np.mean(rows, axis=0) if rows else None


def markdown(r: dict) -> str:
    a = r["config"]
    lines = [f"# Needle-page selection, {a['positions']} positions, {a['digest']} digests, budget {a['budget']}", "",
             f"Run {r['date']}: `{r['command']}`, commit `{r['commit']}`. {r.get('model', 'The shipped tiny model')}; "
             f"{r['split']} trials, {a['trials']} per (length, depth), depths {a['depths']}; "
             + (f"sparse prefill (last 64 queries of each {a['chunk']}-token chunk score pages) and sparse decode"
                if a.get("sparse_prefill", True) else f"dense prefill ({a['chunk']}-token chunks), sparse decode")
             + f"; block {a['block_size']}. *Recall* = share of (answer step, kv head) "
             f"selections that held a page of the needle ({'its key' if a.get('model', 'tiny') == 'tiny' else 'its line'}), "
             + ("per layer; the answer steps are the prompt's last call (its last query gives the first answer "
                "token) and the decode steps." if a.get("sparse_prefill", True) else
                "per layer; the answer steps are the decode steps (the dense prefill gives the first answer token).")
             + ("" if not a.get("resume_instruction") else
                f" Each prompt goes on as the main job's resumed conversation: the answer interrupted at "
                f"{INTERRUPTED!r}, then a new user turn {a['resume_instruction']!r}."), ""]
    if a.get("oracle", "off") != "off":
        lines += [f"**Oracle**: the needle's pages forced into the selections of {a['oracle']} calls, layers "
                  f"{a.get('oracle_layers') or 'all'} (each in place of the earliest retrieved page).", ""]
    lines += ["| length | accuracy | recall, 1st answer step, layers 0…L-1 | recall, all steps | "
              "recall (all steps, mean over layers): right / wrong trials |", "|---|---|---|---|---|"]
    for L in a["lengths"]:
        ts = [t for t in r["records"] if t["length"] == L]
        acc = np.mean([t["correct"] for t in ts])
        first, every = _recall(ts, True), _recall(ts, False)
        right = _recall([t for t in ts if t["correct"]], False)
        wrong = _recall([t for t in ts if not t["correct"]], False)
        fmt = lambda x: " / ".join(f"{v:.2f}" for v in x)  # noqa: E731
        rw = (f"{right.mean():.2f}" if right is not None else "-") + " / " + (
            f"{wrong.mean():.2f}" if wrong is not None else "-")
        lines.append(f"| {L} | {acc:.0%} | {fmt(first)} | {fmt(every)} | {rw} |")
    wrong = [t for t in r["records"] if not t["correct"]]
    if wrong:
        lines += ["", "Wrong answers (digits that match the key in place):", "",
                  "| length | depth | key | answer | digits right |", "|---|---|---|---|---|"]
        for t in wrong:
            # The byte model answers the digits first; a chat model's first 5-digit number is its answer.
            said = (t["answer"][:tasks.KEY_DIGITS] if a.get("model", "tiny") == "tiny"
                    else (re.findall(r"\d{5}", t["answer"]) or [""])[0])
            same = sum(x == y for x, y in zip(said, t["key"]))
            lines.append(f"| {t['length']} | {t['depth']} | {t['key']} | `{t['answer']!r}` | {same} / "
                         f"{tasks.KEY_DIGITS} |")
    return "\n".join(lines) + "\n"
