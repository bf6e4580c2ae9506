"""RULER-style synthetic long-context tasks, generated offline on real text.

Seven tasks in RULER's families (Hsieh et al., 2024), written for a byte-level model:

- retrieval: `niah_single` (one needle; digit, word or uuid-like keys), `niah_multikey` (other
  named needles beside the asked one), `niah_multivalue` (one name planted with several values:
  give them all), `niah_multiquery` (several names asked at once, answered in the asked order),
  `vt` (variable tracking: which variables hold a value, through chains of assignments);
- aggregation: `cwe` (the most common words of a numbered word list) and `fwe` (the most frequent
  words of a Zipf-distributed word stream). An answer here depends on every part of the context,
  which is where selecting the top-k pages should fail.

Every generator takes a uint8 text (the haystack, and the source of the words) and an explicit
`numpy.random.Generator`, and returns a `RulerExample` whose prompt is exactly `length` tokens
(BOS first) and ends where the answer starts. The answer is a comma-separated list closed by a
period. Training uses the same definitions (`training_example`), so the trained format is the
evaluated one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from gemini_jax.data import tasks

BOS = tasks.BOS
MARK = tasks.MARK
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
RETRIEVAL = TASKS[:5]
AGGREGATION = TASKS[5:]
KEY_KINDS = ("digits", "words", "uuid")

NEEDLE = tasks.NEEDLE  # "\n# The pass key{of} is MARK{key}. Remember it.\n": the shipped model's format
ASK_ONE = tasks.QUESTION
ASK_ALL = "\n# What are all the pass keys{of}? They are " + MARK
ASK_MANY = "\n# What are the pass keys of {names}? They are " + MARK
VT_FIRST = "\n# VAR {name} = {value}\n"
VT_HOP = "\n# VAR {name} = VAR {prev}\n"
VT_ASK = "\n# Which variables hold the value {value}? They are " + MARK
CWE_HEAD = "# A numbered list of words. Some of them appear more often than others.\n"
CWE_ASK = "\n# What are the {n} most common words in the list above? They are " + MARK
FWE_HEAD = "# A stream of coded words. Some of them appear more often than others.\n"
FWE_ASK = "\n# What are the {n} most frequent coded words in the stream above? They are " + MARK
_WORD = re.compile(rb"(?<![A-Za-z_])[a-z]{4,9}(?![A-Za-z_0-9])")


@dataclass(frozen=True)
class RulerExample:
    """A prompt (int32[length], BOS first) ending right before its answer."""

    task: str
    prompt: np.ndarray
    answers: tuple[str, ...]
    ordered: bool  # True: the answers must come in this order; False: any order (listed as they
    # appear in the prompt; fwe most frequent first: the order a training target teaches)

    @property
    def target(self) -> str:
        """The text a correct model generates after the prompt."""
        return ", ".join(self.answers) + "."


def parse(generated: str) -> list[str]:
    """The answer list of a continuation: up to the first period or newline, split on commas."""
    head = re.split(r"[.\n]", generated, maxsplit=1)[0]
    return [p.strip() for p in head.split(",") if p.strip()]


def score(generated: str, ex: RulerExample) -> tuple[bool, float]:
    """(exact, recall): exact when the list is the answers (in order if `ex.ordered`, nothing
    extra); recall is the fraction of the answers the list holds (RULER's string-match-all)."""
    got = parse(generated)
    exact = got == list(ex.answers) if ex.ordered else sorted(got) == sorted(ex.answers)
    recall = sum(a in got for a in ex.answers) / len(ex.answers)
    return bool(exact), float(recall)


def random_key(rng: np.random.Generator, kind: str = "digits") -> str:
    if kind == "digits":
        return tasks.random_key(rng)
    if kind == "words":
        return tasks.random_name(rng)
    if kind == "uuid":
        hexd = np.frombuffer(b"0123456789abcdef", np.uint8)
        return bytes(rng.choice(hexd, 4)).decode() + "-" + bytes(rng.choice(hexd, 4)).decode()
    raise ValueError(f"key kind {kind!r} is not one of {KEY_KINDS}.")


def _distinct(make, n: int, taken: set) -> list[str]:
    out = []
    while len(out) < n:
        x = make()
        if x not in taken:
            taken.add(x)
            out.append(x)
    return out


def _to_prompt(body: bytes, length: int, task: str, answers, ordered: bool) -> RulerExample:
    prompt = np.concatenate([[BOS], np.frombuffer(body, np.uint8).astype(np.int32)]).astype(np.int32)
    if len(prompt) != length:
        raise AssertionError(f"{task}: built {len(prompt)} tokens, not {length}")
    return RulerExample(task, prompt, tuple(answers), ordered)


def _plant(text: np.ndarray, hay_len: int, pieces: list[bytes], rng, spots: list[int] | None = None) -> bytes:
    """`pieces` planted into a `hay_len`-byte text window, each after a line break near a random (or
    given, in order) spot, in the order given."""
    if hay_len < 0:
        raise ValueError(f"the context is too short for {len(pieces)} planted lines; raise the length.")
    hay = tasks.text_window(text, hay_len, rng)
    if spots is None:
        spots = sorted(int(rng.integers(0, hay_len + 1)) for _ in pieces)
    out, prev = [], 0
    for at, piece in zip(spots, pieces):
        at = min(max(tasks.snap_to_line(hay, at), prev), hay_len)
        out += [hay[prev:at].tobytes(), piece]
        prev = at
    out.append(hay[prev:].tobytes())
    return b"".join(out)


def _room(length: int, *fixed: bytes) -> int:
    return length - 1 - sum(len(f) for f in fixed)


def niah(text: np.ndarray, length: int, rng: np.random.Generator, *, keys: int = 1, values: int = 1,
         queries: int = 1, kind: str = "digits", task: str = "niah_single") -> RulerExample:
    """The needle family: `keys` named needles (or one unnamed one), the first `values` of them
    under the asked name; `queries` names asked at once."""
    names = _distinct(lambda: tasks.random_name(rng), max(keys, queries), set()) if keys > 1 else [None]
    keyset: set = set()
    per_name = {n: _distinct(lambda: random_key(rng, kind), values if i == 0 else 1, keyset)
                for i, n in enumerate(names)}
    lines = [(n, NEEDLE.format(of=tasks.name_clause(n), key=k).encode()) for n in names for k in per_name[n]]
    order = [int(i) for i in rng.permutation(len(lines))]
    lines = [lines[i] for i in order]
    if queries > 1:
        asked = names[:queries]
        names_text = ", ".join(asked[:-1]) + " and " + asked[-1]
        question = ASK_MANY.format(names=names_text).encode()
        answers, ordered = [per_name[n][0] for n in asked], True
    elif values > 1:
        question = ASK_ALL.format(of=tasks.name_clause(names[0])).encode()
        answers, ordered = per_name[names[0]], False
    else:
        question = ASK_ONE.format(of=tasks.name_clause(names[0])).encode()
        answers, ordered = per_name[names[0]], True
    pieces = [p for _, p in lines]
    body = _plant(text, _room(length, question, *pieces), pieces, rng) + question
    if not ordered:  # listed in the order they appear: one target a model can learn to write
        answers = sorted(answers, key=lambda a: body.index((MARK + a).encode()))
    return _to_prompt(body, length, task, answers, ordered)


def vt(text: np.ndarray, length: int, rng: np.random.Generator, *, hops: int = 4, chains: int = 2) -> RulerExample:
    """Variable tracking: `chains` chains of `hops` assignments (VAR a = 12345, VAR b = VAR a, ...),
    interleaved through the text in chain order; the question names one chain's value and asks for
    every variable holding it."""
    taken: set = set()
    values = _distinct(lambda: tasks.random_key(rng), chains, set())
    chain_names = [_distinct(lambda: tasks.random_name(rng), hops, taken) for _ in range(chains)]
    seqs = []
    for value, names in zip(values, chain_names):
        lines = [VT_FIRST.format(name=names[0], value=value).encode()]
        lines += [VT_HOP.format(name=b, prev=a).encode() for a, b in zip(names, names[1:])]
        seqs.append(lines)
    # Interleave: each chain keeps its order, the chains' lines are shuffled among one another.
    owner = rng.permutation(np.repeat(np.arange(chains), hops))
    nxt = [0] * chains
    pieces = []
    for c in owner:
        pieces.append(seqs[c][nxt[c]])
        nxt[c] += 1
    question = VT_ASK.format(value=values[0]).encode()
    body = _plant(text, _room(length, question, *pieces), pieces, rng) + question
    return _to_prompt(body, length, "vt", chain_names[0], False)


def _word_pool(text: np.ndarray, rng: np.random.Generator, need: int) -> list[str]:
    """Distinct lowercase words (4-9 letters) of a random stretch of the text, shuffled; random
    letter strings make up any shortfall."""
    window = tasks.text_window(text, min(len(text), max(65536, need * 64)), rng).tobytes()
    pool = sorted({m.decode() for m in _WORD.findall(window)})
    pool = [pool[i] for i in rng.permutation(len(pool))]
    taken = set(pool)
    if len(pool) < need:
        pool += _distinct(lambda: tasks.random_name(rng), need - len(pool), taken)
    return pool


def _fill(head: bytes, items: list[bytes], question: bytes, length: int) -> bytes:
    """head + as many items as fit + space padding + question, exactly length - 1 bytes."""
    room = _room(length, head, question)
    out, used = [], 0
    for it in items:
        if used + len(it) > room:
            break
        out.append(it)
        used += len(it)
    return head + b"".join(out) + b" " * (room - used) + question


def cwe(text: np.ndarray, length: int, rng: np.random.Generator, *, common: int = 3, freq_common: int = 8,
        freq_other: int = 2) -> RulerExample:
    """`common` words appear `freq_common` times each in a numbered list whose other words appear at
    most `freq_other` times; the list fills the context. Ask for the common words (any order)."""
    if freq_other >= freq_common:
        raise ValueError("freq_other must be below freq_common, or the common words are not the answer.")
    est = length // 8 + 8  # list items that can fit ("12. word\n" is 8+ bytes)
    pool = _word_pool(text, rng, common + est)
    top, others = pool[:common], pool[common:]
    words = [w for w in top for _ in range(freq_common)]
    k = 0
    while len(words) < est and k < len(others):
        words += [others[k]] * int(rng.integers(1, freq_other + 1))
        k += 1
    room = _room(length, CWE_HEAD.encode(), CWE_ASK.format(n=common).encode())
    # Every common word must make it into the list: keep them within the first items that fit.
    fit = []
    used = 0
    for i, w in enumerate(words):
        line = f"{i + 1}. {w}\n".encode()
        if used + len(line) > room:
            break
        fit.append(w)
        used += len(line)
    if len(fit) < freq_common * common:
        raise ValueError(f"length={length} is too short for {common} words x {freq_common}.")
    # Shuffle what fits, the common words' copies included (they were placed first).
    fit = [fit[i] for i in rng.permutation(len(fit))]
    top = sorted(top, key=fit.index)  # answers in order of first appearance (scored in any order)
    items = [f"{i + 1}. {w}\n".encode() for i, w in enumerate(fit)]
    body = _fill(CWE_HEAD.encode(), items, CWE_ASK.format(n=common).encode(), length)
    return _to_prompt(body, length, "cwe", top, False)


def fwe(text: np.ndarray, length: int, rng: np.random.Generator, *, top: int = 3, alpha: float = 2.0,
        vocab: int = 64) -> RulerExample:
    """A stream of words drawn with Zipf(alpha) weights over `vocab` words fills the context; the
    `top` most frequent are the answer (any order). Counts are made strictly ordered at the cut."""
    pool = _word_pool(text, rng, vocab)[:vocab]
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -alpha
    p /= p.sum()
    question = FWE_ASK.format(n=top).encode()
    room = _room(length, FWE_HEAD.encode(), question)
    n = max(top + 1, room // (np.mean([len(w) for w in pool]) + 1).astype(int))
    while True:  # draw until what fits has a strict gap between rank top and top + 1
        draw = [pool[i] for i in rng.choice(vocab, size=n, p=p)]
        fit, used = [], 0
        for j, w in enumerate(draw):
            piece = (w + ("\n" if j % 12 == 11 else " ")).encode()
            if used + len(piece) > room:
                break
            fit.append(piece)
            used += len(piece)
        words = [f.decode().strip() for f in fit]
        counts = {w: words.count(w) for w in set(words)}
        ranked = sorted(counts, key=lambda w: -counts[w])
        if len(ranked) > top and counts[ranked[top - 1]] > counts[ranked[top]]:
            break
    body = _fill(FWE_HEAD.encode(), fit, question, length)
    return _to_prompt(body, length, "fwe", ranked[:top], False)


def example(task: str, text: np.ndarray, length: int, rng: np.random.Generator, *, kind: str = "digits") -> RulerExample:
    """One trial of `task` at `length` tokens. `kind`: the needle tasks' key kind (KEY_KINDS)."""
    if task == "niah_single":
        return niah(text, length, rng, kind=kind)
    if task == "niah_multikey":
        return niah(text, length, rng, keys=4, kind=kind, task=task)
    if task == "niah_multivalue":
        return niah(text, length, rng, keys=2, values=3, kind=kind, task=task)
    if task == "niah_multiquery":
        return niah(text, length, rng, keys=4, queries=2, kind=kind, task=task)
    if task == "vt":
        return vt(text, length, rng)
    if task == "cwe":
        return cwe(text, length, rng)
    if task == "fwe":
        return fwe(text, length, rng)
    raise ValueError(f"task {task!r} is not one of {TASKS}.")


TRAIN_MARGIN = 96  # bytes kept after a training prompt for its target (+ text after it)


def training_example(task: str, text: np.ndarray, length: int, rng: np.random.Generator,
                     answer_weight: float = 20.0, *, kind: str | None = None):
    """(tokens int32[length + 1], weights f32[length]): a trial of `task` at length + 1 -
    TRAIN_MARGIN tokens, its target, then text to fill the window; the target's bytes weigh
    `answer_weight`, the rest 1. The needle tasks' key kind is drawn when not given."""
    kind = kind or KEY_KINDS[int(rng.integers(0, len(KEY_KINDS)))]
    ex = example(task, text, length + 1 - TRAIN_MARGIN, rng, kind=kind)
    answer = np.frombuffer(ex.target.encode(), np.uint8).astype(np.int32)
    if len(answer) >= TRAIN_MARGIN:
        raise ValueError(f"{task}: a {len(answer)}-byte target does not fit the {TRAIN_MARGIN}-byte margin.")
    after = tasks.text_window(text, TRAIN_MARGIN - len(answer), rng).astype(np.int32)
    toks = np.concatenate([ex.prompt, answer, after]).astype(np.int32)
    w = np.ones(length, np.float32)
    at = len(ex.prompt) - 1  # target index t predicts toks[t + 1]: the answer's first byte
    w[at:at + len(answer)] = answer_weight
    return toks, w
