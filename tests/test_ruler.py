"""The RULER-style generators (gemini_jax.data.ruler) and their harness (gemini_jax.eval.ruler):
prompts of the asked length that end where the answer starts, answers present exactly where they
must be, distractors never equal to an answer, the same trial for the same seed; scoring and the
harness checked with an oracle engine and a wrong one."""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from gemini_jax.data import corpus, ruler
from gemini_jax.errors import ConfigError
from gemini_jax.eval.ruler import RulerPrompts, ruler as run_suite, trial_example
from gemini_jax.eval.trials import Draw

SEEDS = (3, 17, 40)
LENGTHS = (512, 2048)


@pytest.fixture(scope="module")
def text():
    return corpus.load_split("heldout")[1]


def _body(ex) -> str:
    return bytes(ex.prompt[1:].astype(np.uint8)).decode("utf-8", "replace")


def _cases():
    return [(t, L, s) for t in ruler.TASKS for L in LENGTHS for s in SEEDS]


@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_task_gives_a_prompt_of_its_length_ending_at_the_answer_and_is_deterministic(text, task):
    for L in LENGTHS:
        for seed in SEEDS:
            ex = ruler.example(task, text, L, np.random.default_rng(seed))
            where = f"{task} length={L} seed={seed}"
            assert ex.prompt.dtype == np.int32 and len(ex.prompt) == L and ex.prompt[0] == ruler.BOS, where
            assert _body(ex).endswith(ruler.MARK), where
            assert ex.answers and all(a and "," not in a and "." not in a for a in ex.answers), where
            again = ruler.example(task, text, L, np.random.default_rng(seed))
            assert np.array_equal(again.prompt, ex.prompt) and again.answers == ex.answers, where
            other = ruler.example(task, text, L, np.random.default_rng(seed + 1000))
            assert not np.array_equal(other.prompt, ex.prompt), where


@pytest.mark.parametrize("kind", ruler.KEY_KINDS)
@pytest.mark.parametrize("task", ruler.TASKS[:4])
def test_needles_hold_each_answer_once_and_no_distractor_equals_one(text, task, kind):
    shapes = {"digits": r"\d{5}", "words": r"[a-z]{4,7}", "uuid": r"[0-9a-f]{4}-[0-9a-f]{4}"}
    for L in LENGTHS:
        for seed in SEEDS:
            ex = ruler.example(task, text, L, np.random.default_rng(seed), kind=kind)
            body, where = _body(ex), f"{task} {kind} length={L} seed={seed}"
            planted = re.findall(re.escape(ruler.MARK) + "(" + shapes[kind] + r")\. Remember it", body)
            for a in ex.answers:
                assert re.fullmatch(shapes[kind], a), (a, where)
                assert planted.count(a) == 1, (a, planted, where)
            want = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}[task]
            assert len(planted) == want and len(set(planted)) == want, (planted, where)
            assert len(ex.answers) == {"niah_multivalue": 3, "niah_multiquery": 2}.get(task, 1), where


def test_variable_tracking_chains_lead_from_the_asked_value_to_every_answer(text):
    for L in LENGTHS:
        for seed in SEEDS:
            ex = ruler.example("vt", text, L, np.random.default_rng(seed))
            body, where = _body(ex), f"length={L} seed={seed}"
            value = re.search(r"hold the value (\d{5})\?", body).group(1)
            firsts = dict((n, v) for n, v in re.findall(r"# VAR ([a-z]+) = (\d{5})\n", body))
            hops = dict(re.findall(r"# VAR ([a-z]+) = VAR ([a-z]+)\n", body))
            holding = {n for n, v in firsts.items() if v == value}
            grew = True
            while grew:  # follow the assignments from the value to a fixed point
                new = {n for n, prev in hops.items() if prev in holding} - holding
                holding |= new
                grew = bool(new)
            assert holding == set(ex.answers), (holding, ex.answers, where)
            assert list(firsts.values()).count(value) == 1 and len(firsts) == 2, where  # one distractor chain
            # Each chain's lines come in its order: a hop never precedes its source's assignment.
            for n, prev in hops.items():
                assert body.index(f"# VAR {prev} = ") < body.index(f"# VAR {n} = VAR {prev}"), where


@pytest.mark.parametrize("task", ruler.AGGREGATION)
def test_aggregation_answers_are_strictly_the_most_frequent_words(text, task):
    for L in (1024, 4096):
        for seed in SEEDS:
            ex = ruler.example(task, text, L, np.random.default_rng(seed))
            if task == "fwe" and seed == SEEDS[0]:  # a flat Zipf ties often: the draw must still give a strict top
                ex = ruler.fwe(text, L, np.random.default_rng(seed), alpha=0.3)
            body, where = _body(ex), f"{task} length={L} seed={seed}"
            listed = body.split("\n", 1)[1].rsplit("\n#", 1)[0]
            words = re.findall(r"^\d+\. ([a-z]+)$", listed, re.M) if task == "cwe" else listed.split()
            counts = Counter(words)
            assert len(counts) > 10, where
            least_answer = min(counts[a] for a in ex.answers)
            most_other = max(c for w, c in counts.items() if w not in ex.answers)
            assert least_answer > most_other, (ex.answers, counts.most_common(5), where)
            if task == "cwe":  # numbered 1..n without a gap
                nums = [int(n) for n in re.findall(r"^(\d+)\. ", listed, re.M)]
                assert nums == list(range(1, len(nums) + 1)), where


@pytest.mark.parametrize("task", ["niah_multivalue", "cwe", "vt"])
def test_unordered_answers_are_listed_in_the_order_they_first_appear(text, task):
    """A training target a model can learn: the any-order tasks list their answers as they appear."""
    for seed in SEEDS:
        ex = ruler.example(task, text, 2048, np.random.default_rng(seed))
        body = _body(ex)
        form = {"niah_multivalue": ruler.MARK + "{}", "cwe": ". {}\n", "vt": "VAR {} ="}[task]
        where = [body.index(form.format(a)) for a in ex.answers]
        assert not ex.ordered and where == sorted(where), (task, seed, ex.answers, where)


def test_too_short_a_context_is_a_clear_error(text):
    with pytest.raises(ValueError, match="too short"):
        ruler.example("niah_multivalue", text, 200, np.random.default_rng(0))
    with pytest.raises(ValueError, match="not one of"):
        ruler.example("qa", text, 1024, np.random.default_rng(0))
    with pytest.raises(ValueError, match="key kind"):
        ruler.example("niah_single", text, 1024, np.random.default_rng(0), kind="emoji")


def test_scoring_exact_and_recall():
    unordered = ruler.RulerExample("niah_multivalue", np.zeros(1, np.int32), ("11111", "22222", "33333"), False)
    ordered = ruler.RulerExample("niah_multiquery", np.zeros(1, np.int32), ("11111", "22222"), True)
    assert ruler.score("33333, 11111, 22222. and on", unordered) == (True, 1.0)
    assert ruler.score("11111, 22222\nmore", unordered) == (False, pytest.approx(2 / 3))
    assert ruler.score("11111, 22222, 33333, 44444.", unordered) == (False, 1.0)  # an extra answer is not exact
    assert ruler.score("22222, 11111.", ordered) == (False, 1.0)  # right keys, wrong order
    assert ruler.score("11111, 22222.", ordered) == (True, 1.0)
    assert ruler.score("", ordered) == (False, 0.0)
    assert ordered.target == "11111, 22222."


def test_training_examples_weigh_exactly_the_target(text):
    rng = np.random.default_rng(5)
    for task in ruler.TASKS:
        toks, w = ruler.training_example(task, text, 1024, rng, answer_weight=20.0)
        assert toks.shape == (1025,) and w.shape == (1024,), task
        heavy = np.flatnonzero(w == 20.0)
        assert len(heavy) and np.all(np.diff(heavy) == 1), task
        target = bytes(toks[heavy + 1].astype(np.uint8)).decode()
        assert target.endswith(".") and bytes(toks[heavy[0]:heavy[0] + 1].astype(np.uint8)).decode() == ruler.MARK, \
            (task, target)


class _Oracle:
    """Answers every prompt it was shown with its target (or a planted wrong one)."""

    def __init__(self, examples, wrong=False):
        self.table = {tuple(map(int, e.prompt)): e for e in examples}
        self.wrong = wrong

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            e = self.table[tuple(p)]
            ans = list(e.answers)
            if self.wrong:  # an ordered list reversed; otherwise the first answer misspelt
                ans = ans[::-1] if e.ordered and len(ans) > 1 else ["x" + ans[0][1:], *ans[1:]]
            text = ", ".join(ans) + ".\nmore"
            out.append(list(text.encode())[:params.max_new_tokens])
        return SimpleNamespace(tokens=out)


@pytest.mark.parametrize("task", ["niah_multiquery", "cwe"])
def test_harness_scores_an_oracle_full_and_a_wrong_engine_by_what_it_got(text, task):
    lengths, trials, draw = [512, 1024], 3, Draw("test", 7)
    exs = [trial_example(text, task, lengths, (i, t), draw) for i in range(2) for t in range(trials)]
    good = run_suite(_Oracle(exs), task, lengths, trials=trials, haystack=text, draw=draw, batch=2)
    assert [r["accuracy"] for r in good.by_length()] == [1.0, 1.0], good.records
    bad = run_suite(_Oracle(exs, wrong=True), task, lengths, trials=trials, haystack=text, draw=draw)
    rows = bad.by_length()
    assert [r["accuracy"] for r in rows] == [0.0, 0.0]
    # niah_multiquery is ordered: reversed keys are all named (recall 1) but not exact; cwe is not ordered.
    assert [r["recall"] for r in rows] == ([1.0, 1.0] if task == "niah_multiquery" else [2 / 3, 2 / 3])
    # dev and test draw other trials; the needle grid's stream is not the suite's
    dev = trial_example(text, task, lengths, (0, 0), Draw("dev", 7))
    assert not np.array_equal(dev.prompt, exs[0].prompt)
    assert good.to_dict()["by_length"][0]["ci95"][1] == 1.0


def test_harness_refuses_unknown_task_and_kind(text):
    with pytest.raises(ConfigError, match="task"):
        run_suite(None, "qa", [512], haystack=text)
    with pytest.raises(ConfigError, match="kind"):
        run_suite(None, "niah_single", [512], haystack=text, prompts=RulerPrompts(kind="emoji"))
