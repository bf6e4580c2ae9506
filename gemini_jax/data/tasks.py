"""Training and evaluation examples built on real text: language modelling, repeated spans
(content-based induction), pass-key needles and key -> value recall.

All generators take an explicit `numpy.random.Generator` and a uint8 text array, and return
token ids (byte tokenizer) plus a per-token loss weight, so training and evaluation share one
definition of each task.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gemini_jax.errors import ConfigError
from gemini_jax.tokenizer import ByteTokenizer

BOS = ByteTokenizer.BOS
# MARK (a byte that never occurs in the corpus) precedes the key in the needle and ends the
# question: at byte level, "is " alone matches hundreds of earlier places, so retrieval would need
# a multi-byte prefix match; with the marker one-token induction (find the earlier MARK, copy what
# follows) suffices, which a small model learns far sooner.
MARK = "\x1e"
NEEDLE = "\n# The pass key{of} is " + MARK + "{key}. Remember it.\n"
QUESTION = "\n# What is the pass key{of}? The pass key{of} is " + MARK
KEY_DIGITS = 5


def name_clause(name: str | None) -> str:
    return f" of {name}" if name else ""


def random_key(rng: np.random.Generator) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, KEY_DIGITS))


def random_name(rng: np.random.Generator) -> str:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    return bytes(rng.choice(letters, int(rng.integers(4, 8)))).decode()


# A haystack shorter than this repeats itself every few lines once tiled to a context: the task
# then measures copying a pattern, not finding a needle in text.
MIN_HAYSTACK_BYTES = 256


def check_haystack(text) -> np.ndarray:
    """The haystack as uint8 text, or ConfigError when it is empty or shorter than MIN_HAYSTACK_BYTES."""
    arr = np.asarray(text)
    if arr.ndim != 1 or len(arr) == 0:
        raise ConfigError(f"haystack is empty (shape {arr.shape}): give a 1-D uint8 text of at least "
                          f"{MIN_HAYSTACK_BYTES} bytes (default: the held-out standard-library sources).")
    if len(arr) < MIN_HAYSTACK_BYTES:
        raise ConfigError(f"haystack has {len(arr)} bytes, fewer than the {MIN_HAYSTACK_BYTES} a task needs "
                          f"(it would repeat every few lines); give a longer text.")
    return arr


def text_window(text: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n consecutive bytes from a random offset (wrapping text shorter than n). ConfigError for a
    haystack that is empty or too short (check_haystack)."""
    check_haystack(text)
    if len(text) >= n:
        start = int(rng.integers(0, len(text) - n + 1))
        return text[start:start + n]
    reps = -(-n // len(text)) + 1
    start = int(rng.integers(0, len(text)))
    return np.tile(text, reps)[start:start + n]


@dataclass(frozen=True)
class NeedleExample:
    """A prompt that ends right before the answer; `answer` is the expected continuation."""

    prompt: np.ndarray  # int32[length]
    answer: str
    depth: float
    needle_at: int  # token index where the asked-for needle starts


def snap_to_line(hay: np.ndarray, at: int, limit: int = 200) -> int:
    """Move an insertion point forward to just after a newline, if one is near."""
    nl = np.flatnonzero(hay[at:at + limit] == ord("\n"))
    return at + int(nl[0]) + 1 if len(nl) else at


def needle_example(text: np.ndarray, length: int, depth: float, rng: np.random.Generator,
                   *, distractors: int = 0, key: str | None = None) -> NeedleExample:
    """A pass-key needle planted at `depth` (0 = start, 1 = end) of a `length`-token prompt.

    With distractors > 0 the needles are named (key -> value recall): other named keys are
    planted at random depths and the question asks for one name.
    """
    key = key or random_key(rng)
    name = random_name(rng) if distractors else None
    needle = NEEDLE.format(of=name_clause(name), key=key).encode()
    question = QUESTION.format(of=name_clause(name)).encode()
    others = []
    used = {name}
    for _ in range(distractors):
        other = random_name(rng)
        while other in used:
            other = random_name(rng)
        used.add(other)
        others.append(NEEDLE.format(of=name_clause(other), key=random_key(rng)).encode())
    hay_len = length - 1 - len(needle) - len(question) - sum(len(o) for o in others)
    if hay_len < 0:
        raise ValueError(f"length={length} is too short for a needle example.")
    hay = text_window(text, hay_len, rng)
    pieces = [(min(hay_len, snap_to_line(hay, int(depth * hay_len))), needle, True)]
    for o in others:
        pieces.append((snap_to_line(hay, int(rng.integers(0, hay_len + 1))), o, False))
    pieces.sort(key=lambda p: p[0])
    out, prev, needle_at = [], 0, 0
    for at, piece, is_target in pieces:
        at = min(max(at, prev), hay_len)
        out.append(hay[prev:at].tobytes())
        if is_target:
            needle_at = 1 + sum(len(x) for x in out)
        out.append(piece)
        prev = at
    out.append(hay[prev:].tobytes())
    out.append(question)
    prompt = np.concatenate([[BOS], np.frombuffer(b"".join(out), np.uint8).astype(np.int32)])
    assert len(prompt) == length, (len(prompt), length)
    return NeedleExample(prompt.astype(np.int32), key, depth, needle_at)


def lm_example(text: np.ndarray, length: int, rng: np.random.Generator):
    """(tokens int32[length + 1], weights f32[length]): plain next-byte prediction."""
    toks = np.concatenate([[BOS], text_window(text, length, rng).astype(np.int32)])
    return toks.astype(np.int32), np.ones(length, np.float32)


def repeat_example(text: np.ndarray, length: int, rng: np.random.Generator):
    """A text window in which a random span reappears at a random later offset.

    Predicting the copy needs content-based lookup (an induction head), not a fixed offset.
    Spans are long (up to half the window) so the signal for learning that lookup is strong.
    """
    toks, w = lm_example(text, length, rng)
    span = int(rng.integers(16, max(17, length // 2)))
    src = int(rng.integers(1, length - 2 * span + 1))
    dst = int(rng.integers(src + span, length - span + 1))
    toks[dst:dst + span] = toks[src:src + span].copy()
    return toks, w


def needle_training_example(text: np.ndarray, length: int, rng: np.random.Generator,
                            answer_weight: float = 20.0):
    """A needle / key-value example with its answer appended; the answer bytes weigh more."""
    distractors = int(rng.integers(0, min(3, length // 160) + 1))  # leave room for haystack
    ex = needle_example(text, length + 1 - KEY_DIGITS, float(rng.random()), rng,
                        distractors=distractors)
    toks = np.concatenate([ex.prompt, np.frombuffer(ex.answer.encode(), np.uint8).astype(np.int32)])
    w = np.ones(length, np.float32)
    w[-KEY_DIGITS:] = answer_weight
    return toks.astype(np.int32), w


def multi_needle_training_example(text: np.ndarray, length: int, rng: np.random.Generator,
                                  answer_weight: float = 20.0, questions: int = 4):
    """Several named needles at random depths, then `questions` questions about them, each
    followed by its answer: one sequence trains retrieval from several depths at once.

    (tokens int32[length + 1], weights f32[length]); every answer byte weighs `answer_weight`.
    """
    names, used = [], set()
    while len(names) < questions + int(rng.integers(0, 3)):
        n = random_name(rng)
        if n not in used:
            used.add(n)
            names.append(n)
    keys = [random_key(rng) for _ in names]
    needles = [NEEDLE.format(of=name_clause(n), key=k).encode() for n, k in zip(names, keys)]
    asked = [int(i) for i in rng.permutation(len(names))[:questions]]
    tail, answer_at = [], []
    for i in asked:
        q = QUESTION.format(of=name_clause(names[i])).encode()
        start = sum(len(x) for x in tail) + len(q)
        answer_at.append(start)
        tail.append(q + keys[i].encode() + b".")
    tail = b"".join(tail)
    hay_len = length + 1 - 1 - len(tail) - sum(len(x) for x in needles)
    if hay_len < 16:
        raise ValueError(f"length={length} is too short for {questions} questions.")
    hay = text_window(text, hay_len, rng)
    spots = sorted(snap_to_line(hay, int(rng.integers(0, hay_len + 1))) for _ in needles)
    out, prev = [], 0
    for at, piece in zip(spots, needles):
        at = min(max(at, prev), hay_len)
        out += [hay[prev:at].tobytes(), piece]
        prev = at
    out.append(hay[prev:].tobytes())
    body = b"".join(out)
    toks = np.concatenate([[BOS], np.frombuffer(body + tail, np.uint8).astype(np.int32)])
    assert len(toks) == length + 1, (len(toks), length)
    w = np.ones(length, np.float32)
    base = 1 + len(body)  # token index of the tail's first byte
    for a in answer_at:
        # target index t predicts toks[t + 1]: the answer's first byte is toks[base + a]
        w[base + a - 1:base + a - 1 + KEY_DIGITS] = answer_weight
    return toks.astype(np.int32), w
