"""The RULER-style task suite (`gemini_jax.data.ruler`) over a grid of context lengths.

A trial scores exact when the generated answer list is the expected one (in order where the task
asks for an order), and its recall is the fraction of expected answers it names (RULER's
string-match-all). Trials are drawn per (task, length, trial) from `Draw(split, seed)` on a stream
of their own, so every engine sees the same prompts and no needle trial shares one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from gemini_jax.config import SamplingParams
from gemini_jax.data import chat
from gemini_jax.data import ruler as suite
from gemini_jax.data import tasks
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.intervals import wilson
from gemini_jax.eval.trials import Draw
from gemini_jax.errors import ConfigError
from gemini_jax.tokenizer import ByteTokenizer

STREAM = 0x52554C  # the suite's first entropy word: its trials share no generator with the needle grid's
ANSWER_SLACK = 8   # tokens generated past the longest expected answer of a batch
CHAT_ANSWER_SLACK = 16  # a chat model's words around its answers ("The pass keys are ...")


@dataclass
class RulerResult:
    task: str
    lengths: list[int]
    trials: int
    kind: str
    records: list[dict] = field(default_factory=list)  # per trial: length, trial, answers, generated, exact, recall

    def by_length(self) -> list[dict]:
        """Per length: exact hits with a 95% Wilson interval, and the mean recall."""
        out = []
        for L in self.lengths:
            rows = [r for r in self.records if r["length"] == L]
            hits = sum(r["exact"] for r in rows)
            lo, hi = wilson(hits, len(rows))
            out.append({"length": L, "hits": hits, "trials": len(rows), "accuracy": hits / len(rows),
                        "ci95": [lo, hi], "recall": float(np.mean([r["recall"] for r in rows]))})
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["by_length"] = self.by_length()
        return d


@dataclass(frozen=True)
class RulerPrompts:
    """How trials are written. kind: the needle tasks' key kind (`gemini_jax.data.ruler.KEY_KINDS`).
    tokenizer: a chat model's tokenizer (one with a chat template: the tasks are asked through it and
    free-text answers scored as RULER scores them); None: the byte model's format."""

    kind: str = "digits"
    tokenizer: object = None


def trial_example(haystack: np.ndarray, task: str, lengths, index: tuple[int, int], draw: Draw,
                  kind: str = "digits", tokenizer=None) -> suite.RulerExample:
    """Trial `index` = (length i, trial t) of `task`: the same prompt for every engine and run.
    With `tokenizer` (a chat model's, e.g. `gj.GGUFTokenizer`), the trial is the same task asked
    through the model's chat template (`gemini_jax.data.chat.chat_ruler_example`)."""
    if task not in suite.TASKS:
        raise ConfigError(f"task={task!r} is not one of {suite.TASKS}.")
    i, t = index
    rng = draw.rng(STREAM, suite.TASKS.index(task), i, t)
    if tokenizer is not None:
        return chat.chat_ruler_example(haystack, tokenizer, task, int(lengths[i]), rng, kind=kind)
    return suite.example(task, haystack, int(lengths[i]), rng, kind=kind)


def answer(engine, examples, tokenizer=None) -> list[str]:
    """The engine's greedy continuation of each prompt, as text (bytes < 256; with a chat
    tokenizer, its decoding, the model's EOS ending it)."""
    if tokenizer is not None:
        n = max(len(tokenizer.encode(", ".join(e.answers))) for e in examples) + CHAT_ANSWER_SLACK
        out = engine.generate([list(map(int, e.prompt)) for e in examples],
                              SamplingParams(max_new_tokens=n, temperature=0.0))
        return [tokenizer.decode(gen) for gen in out.tokens]
    n = max(len(e.target.encode()) for e in examples) + ANSWER_SLACK
    params = SamplingParams(max_new_tokens=n, temperature=0.0, stop_at_eos=False)
    out = engine.generate([list(map(int, e.prompt)) for e in examples], params)
    return [ByteTokenizer().decode([t for t in gen if t < 256]) for gen in out.tokens]


def score(text: str, example: suite.RulerExample, chat_model: bool = False) -> tuple[bool, float]:
    """(exact, recall) of one answer: the suite's list format, or a chat model's free-form answer."""
    return chat.chat_ruler_score(text, example) if chat_model else suite.score(text, example)


def ruler(engine, task: str, lengths, *, trials: int = 10, haystack: np.ndarray | None = None,
          draw: Draw = Draw("test", 0), batch: int = 1, prompts: RulerPrompts = RulerPrompts()) -> RulerResult:
    """Exact-match accuracy and recall of `task` at each length over `trials` trials.

    engine: anything with `generate(prompts, SamplingParams) -> .tokens`. haystack: uint8 text
    (default: the held-out standard-library sources). draw: the split and base seed of the trials
    (`gemini_jax.eval.trials`: report test trials, choose knobs on dev ones). prompts: the key kind
    and, for a chat model, its tokenizer (`RulerPrompts`). Records come length-major, trials in order.
    """
    kind, tokenizer = prompts.kind, prompts.tokenizer
    if task not in suite.TASKS:
        raise ConfigError(f"task={task!r} is not one of {suite.TASKS}.")
    if kind not in suite.KEY_KINDS:
        raise ConfigError(f"kind={kind!r} is not one of {suite.KEY_KINDS}.")
    if trials < 1 or batch < 1:
        raise ConfigError(f"trials={trials} and batch={batch} must be positive.")
    haystack = heldout_text() if haystack is None else tasks.check_haystack(haystack)
    result = RulerResult(task, [int(x) for x in lengths], trials, kind)
    bar = tqdm(total=len(lengths) * trials, desc=f"ruler {task}", disable=None, unit="trial")
    for i, L in enumerate(result.lengths):
        examples = [trial_example(haystack, task, result.lengths, (i, t), draw, kind, tokenizer) for t in range(trials)]
        for b in range(0, trials, batch):
            group = examples[b:b + batch]
            for t, (e, text) in enumerate(zip(group, answer(engine, group, tokenizer)), b):
                exact, recall = score(text, e, tokenizer is not None)
                result.records.append({"length": L, "trial": t, "answers": list(e.answers), "generated": text,
                                       "exact": exact, "recall": recall})
            bar.update(len(group))
    bar.close()
    return result
