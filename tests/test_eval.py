"""The evaluation harness scores a scripted oracle 100%, a random engine ~0%, and exact match only."""

import re
from types import SimpleNamespace

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.eval import is_correct, needle, perplexity, unigram_bits_per_byte, write_needle
from gemini_jax.eval.needle import NeedlePrompts
from gemini_jax.eval.trials import Draw
from gemini_jax.testing import contract_tolerance, float_tolerance, random_model, tiny_config


class OracleEngine:
    """Reads the asked-for key out of the prompt, as a perfect retriever would."""

    def generate(self, prompts, params):
        outs = []
        for p in prompts:
            text = bytes(t for t in p if t < 256).decode("utf-8", "replace")
            name = re.search(r"What is the pass key( of \w+)?\?", text).group(1) or ""
            key = re.search(rf"The pass key{re.escape(name)} is \x1e(\d+)\. Remember", text).group(1)
            outs.append(list(key.encode()) + [ord(".")])
        return SimpleNamespace(tokens=outs)


class RandomEngine:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def generate(self, prompts, params):
        return SimpleNamespace(tokens=[list(self.rng.integers(48, 58, params.max_new_tokens)) for _ in prompts])


def test_oracle_scores_100_and_random_scores_near_0(tmp_path):
    lengths, depths = [300, 1200], [0.0, 0.5, 1.0]
    res = needle(OracleEngine(), lengths, depths, trials=4, draw=Draw("test", 33))
    assert res.overall == 1.0
    kv = needle(OracleEngine(), [1500], [0.3], trials=4, prompts=NeedlePrompts(distractors=3))
    assert kv.overall == 1.0
    rnd = needle(RandomEngine(seed=9), lengths, depths, trials=20)
    assert rnd.overall <= 0.05  # chance of guessing 5 digits (and no 6th) is ~1e-5
    write_needle(res, str(tmp_path), "oracle", "oracle")
    assert all((tmp_path / f"oracle.{e}").exists() for e in ("json", "md", "png"))


class CountingOracle(OracleEngine):
    def __init__(self):
        self.prompts = 0

    def generate(self, prompts, params):
        self.prompts += len(prompts)
        return super().generate(prompts, params)


def test_an_interrupted_needle_grid_continues_from_its_journal(tmp_path):
    """Cells a journal holds are not measured again; the result equals one uninterrupted run."""
    from gemini_jax.eval.journal import CellJournal

    lengths, depths, draw = [300, 600], [0.2, 0.8], Draw("test", 41)
    whole = needle(OracleEngine(), lengths, depths, trials=3, draw=draw)
    path = str(tmp_path / "n.partial.jsonl")
    first = CountingOracle()
    needle(first, lengths, depths, trials=3, draw=draw, journal=CellJournal(path, {"seed": 41}))
    assert first.prompts == 12
    with open(path) as fh:  # the run stopped after its first two cells (header + 2 lines kept)
        kept = fh.read().split("\n")[:3]
    with open(path, "w") as fh:
        fh.write("\n".join(kept) + "\n")
    again = CountingOracle()
    res = needle(again, lengths, depths, trials=3, draw=draw, journal=CellJournal(path, {"seed": 41}))
    assert again.prompts == 6, "draw seed 41: the two kept cells were measured again"
    assert res.records == whole.records and res.accuracy == whole.accuracy


def test_exact_match_only():
    assert is_correct("12345.", "12345")
    assert is_correct("12345", "12345")
    assert not is_correct("123456", "12345")
    assert not is_correct("1234", "12345")
    assert not is_correct(" 12345", "12345")
    assert not is_correct("12346", "12345")


def _logprob_tolerance(cfg, context: int, ref) -> float:
    """Two float evaluations of log-probs: the decoder's layers (each with its widest reduction: a
    matmul, the attention over the context or the vocabulary's log-sum-exp), then the log-softmax."""
    return float_tolerance(depth=cfg.num_layers + 1, terms=max(cfg.intermediate_size, cfg.vocab_size, context),
                           magnitude=np.abs(ref).max())


def test_score_matches_forward_and_perplexity_runs():
    seed = 1
    rng = np.random.default_rng(seed)
    cfg = tiny_config("tiny", vocab_size=259)
    model = random_model(cfg, int(rng.integers(100)))
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=256, prefill_chunk=32))
    toks = [int(x) for x in rng.integers(0, 256, 60)]
    logp = eng.score(toks[:40], toks[40:]).tokens
    full = np.asarray(gj.forward(model, toks))
    ref = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    want = ref[np.arange(39, 59), toks[40:60]]
    np.testing.assert_allclose(logp, want, atol=_logprob_tolerance(cfg, 60, want), rtol=0, err_msg=f"seed={seed}")
    out = perplexity(eng, 128, windows=2, scored=32)
    assert 7.0 < out["bits_per_byte"] < 12  # a random model is near log2(259) bits
    assert 4.0 < unigram_bits_per_byte() < 6.0


def test_digest_recall_is_exact_for_single_token_pages():
    """With one key per page and one query head per kv head, a digest *is* the key, so the
    digest ranking is the attention-mass ranking: recall must be 1. Coarser pages recall less."""
    from gemini_jax.eval import RecallSetting, digest_recall

    seed = 21
    rng = np.random.default_rng(seed)
    cfg = tiny_config("tiny", num_heads=2, num_kv_heads=2, head_dim=32)
    model = random_model(cfg, seed)
    toks = [int(x) for x in rng.integers(0, cfg.vocab_size, 120)]
    exact = digest_recall(model, toks, RecallSetting(block_size=1, k_pages=8, sink_pages=1, local_pages=1), queries=3)
    assert exact == {"minmax": 1.0, "mean": 1.0}
    # Reranking by the exact largest q.k of a one-key page is the logit ranking too.
    reranked = digest_recall(model, toks, RecallSetting(block_size=1, k_pages=8, sink_pages=1, local_pages=1, rerank=2),
                             queries=3)
    assert reranked == {"minmax": 1.0, "mean": 1.0, "minmax+rerank2": 1.0, "mean+rerank2": 1.0}
    coarse = digest_recall(model, toks, RecallSetting(block_size=8, k_pages=3), queries=3)
    assert all(0.0 <= v <= 1.0 for v in coarse.values())
    assert coarse == pytest.approx(_brute_force_recall(model, toks, block_size=8, k_pages=3, queries=3)), seed
    assert min(coarse.values()) < 1.0, (seed, coarse)  # eight keys per page: the digests miss some


def _brute_force_recall(model, toks, *, block_size, k_pages, queries, sink_pages=1, local_pages=2):
    """Recall spelled out one page at a time: the exact attention mass a page holds against the
    score its digest gives (minmax: sum_d max(q_d lo_d, q_d hi_d); mean: q . mean key), both
    reduced over the kv head's group by sum (mass) and max (score)."""
    from gemini_jax.eval.recall import record_qk

    cfg = model.cfg
    q_all, k_all = record_qk(model, toks)
    q_all, k_all = q_all.astype(np.float64), k_all.astype(np.float64)
    G, S, T = cfg.num_heads // cfg.num_kv_heads, block_size, len(toks)
    hits = {"minmax": [], "mean": []}
    for pos in range(T - queries, T):
        n_pages = pos // S + 1
        candidates = list(range(sink_pages, n_pages - local_pages))
        if len(candidates) <= k_pages:
            continue
        for layer in range(cfg.num_layers):
            for h in range(cfg.num_kv_heads):
                qs = q_all[layer, pos, h * G:(h + 1) * G]  # [G, D]
                keys = k_all[layer, :pos + 1, h]  # [t, D]
                logits = qs @ keys.T * cfg.scale
                probs = np.exp(logits - logits.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                mass, score = {}, {"minmax": {}, "mean": {}}
                for page in candidates:
                    page_keys = keys[page * S:min(pos + 1, (page + 1) * S)]
                    mass[page] = probs[:, page * S:page * S + len(page_keys)].sum()
                    lo, hi = page_keys.min(0), page_keys.max(0)
                    score["minmax"][page] = max(np.maximum(q * lo, q * hi).sum() for q in qs)
                    score["mean"][page] = max(q @ page_keys.mean(0) for q in qs)
                true = set(sorted(candidates, key=lambda p: -mass[p])[:k_pages])
                for kind in hits:
                    sel = set(sorted(candidates, key=lambda p: -score[kind][p])[:k_pages])
                    hits[kind].append(len(true & sel) / k_pages)
    return {kind: float(np.mean(v)) for kind, v in hits.items()}


def test_dev_trials_are_the_earlier_derivation_and_test_trials_are_disjoint():
    """dev keeps the derivation the presets were tuned on; test draws other prompts (keys and
    haystack offsets); a misspelt split is refused by name."""
    seed = 5
    dev = Draw("dev", seed)
    assert np.array_equal(dev.rng(1, 2, 3).integers(0, 1 << 30, 8),
                          np.random.default_rng([seed, 1, 2, 3]).integers(0, 1 << 30, 8)), f"seed={seed}"
    hay = np.random.default_rng(seed).integers(32, 127, 50_000).astype(np.uint8)
    from gemini_jax.data import tasks

    def prompts(split):
        d = Draw(split, seed)
        return {tasks.needle_example(hay, 2000, 0.5, d.rng(0, 0, t)).prompt.tobytes() for t in range(40)}

    assert len(prompts("dev")) == len(prompts("test")) == 40
    assert not prompts("dev") & prompts("test"), f"seed={seed}: a test trial is also a dev trial"
    with pytest.raises(gj.errors.ConfigError, match="split='tset'"):
        Draw("tset", seed)


def test_intervals_match_known_values():
    from gemini_jax.eval.intervals import mean_t95, t95, wilson

    assert t95(1) == 12.706 and t95(30) == 2.042
    assert t95(31) == pytest.approx(2.0395, abs=1e-3) and t95(99) == pytest.approx(1.9842, abs=1e-3)
    lo, hi = wilson(97, 100)  # Wilson 95% for 97/100: [0.9155, 0.9897]
    assert lo == pytest.approx(0.9155, abs=1e-3) and hi == pytest.approx(0.9897, abs=1e-3)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    m, lo, hi = mean_t95([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd 1.291, t(3) 3.182
    assert (m, lo, hi) == pytest.approx((2.5, 2.5 - 3.182 * 1.2910 / 2, 2.5 + 3.182 * 1.2910 / 2), abs=1e-3)
    from gemini_jax.eval.intervals import paired_difference

    # Many pairs: Newcombe's interval meets the normal one for paired proportions, (b - c)/n +- z se.
    d, lo, hi = paired_difference(5000, 1200, 1000, 2800)
    se = ((1200 + 1000) - (1200 - 1000) ** 2 / 10000) ** 0.5 / 10000
    assert (d, lo, hi) == pytest.approx((0.02, 0.02 - 1.96 * se, 0.02 + 1.96 * se), abs=2e-4)
    # No trial differs: the difference is 0, yet 100 trials cannot exclude a few points either way.
    d, lo, hi = paired_difference(95, 0, 0, 5)
    assert d == 0 and -0.05 < lo < -0.02 and 0.02 < hi < 0.05 and lo == pytest.approx(-hi)
    # Swapping the systems mirrors the interval.
    d, lo, hi = paired_difference(90, 3, 1, 6)
    assert paired_difference(90, 1, 3, 6) == pytest.approx((-d, -hi, -lo)) and lo < d < hi


def test_batched_scoring_equals_one_request_at_a_time():
    """Engine.score shares decode steps between requests of equal continuation length; each
    row's log-probs must be what it gets alone (rows never mix)."""
    seed = 21
    rng = np.random.default_rng(seed)
    model = random_model(tiny_config("tiny", vocab_size=259), seed)
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=128, prefill_chunk=32, max_batch=3))
    reqs = [([int(x) for x in rng.integers(0, 256, n)], [int(x) for x in rng.integers(0, 256, m)])
            for n, m in [(40, 12), (37, 12), (51, 12), (45, 12), (30, 7)]]  # groups: 3, 1 (max_batch), 1 (length)
    together = eng.score([p for p, _ in reqs], [c for _, c in reqs]).tokens
    for i, (p, c) in enumerate(reqs):
        # The contract (gemini_jax.eval.reproduce, under its BPB_TOL): 1e-5 × max(1, max|ref|); the float bound where tighter.
        tol = contract_tolerance(_logprob_tolerance(model.cfg, len(p) + len(c), together[i]), together[i], contract=1e-5)
        np.testing.assert_allclose(together[i], eng.score(p, c).tokens, atol=tol, rtol=0,
                                   err_msg=f"seed={seed} request {i}")


def test_perplexity_reports_a_t_interval_over_windows():
    seed = 8
    model = random_model(tiny_config("tiny", vocab_size=259), seed)
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=256, prefill_chunk=32, max_batch=4))
    out = perplexity(eng, 96, windows=5, scored=16, draw=Draw("test", seed))
    assert len(out["per_window"]) == 5 and out["split"] == "test"
    from gemini_jax.eval.intervals import mean_t95

    assert (out["bits_per_byte"], *out["ci95"]) == pytest.approx(mean_t95(out["per_window"]))
    assert out["ci95"][0] < out["bits_per_byte"] < out["ci95"][1], f"seed={seed}"


def test_a_record_reruns_trial_by_trial_and_a_changed_figure_is_caught():
    """gemini_jax.eval.reproduce: a sample of a needle / bits-per-byte record's trials, rerun through
    the same engine, reproduces it exactly; a recorded answer or window figure that the code no
    longer produces is counted as different, and a record whose trials cannot be redrawn is refused."""
    from gemini_jax.eval import reproduce

    seed = 12
    model = random_model(tiny_config("tiny", vocab_size=259), seed)
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=512, prefill_chunk=64, max_batch=4))
    draw = Draw("test", seed)
    res = needle(eng, [160, 300], [0.2, 0.8], trials=2, draw=draw)
    record = {"name": "n", "split": "test", "seeds": [seed], "config": {}, **res.to_dict()}
    out = reproduce.rerun_needle(eng, record, 5)
    assert (out["checked"], out["equal"]) == (5, 5), f"seed={seed} {out}"
    assert [r["trial"] for r in out["rows"]] == reproduce.spread(8, 5) == [0, 2, 4, 5, 7]
    planted = {**record, "records": [dict(r) for r in record["records"]]}
    planted["records"][4]["generated"] += "x"  # a figure the code does not produce
    out = reproduce.rerun_needle(eng, planted, 5)
    assert out["equal"] == 4 and [r["trial"] for r in out["rows"] if not r["equal"]] == [4], f"seed={seed}"
    planted["records"][4]["key"] = "00000" if planted["records"][4]["key"] != "00000" else "11111"
    with pytest.raises(gj.errors.ConfigError, match="derivation changed"):
        reproduce.rerun_needle(eng, planted, 5)

    rows = [perplexity(eng, c, windows=3, scored=16, draw=draw) for c in (96, 200)]
    bpb = {"name": "b", "split": "test", "seeds": [seed], "records": rows}
    out = reproduce.rerun_bpb(eng, bpb, 2)
    # windows 0 and 2 are sampled; the 3 windows were scored as one batch (max_batch 4): all rerun
    assert (out["checked"], out["equal"]) == (6, 6) and out["max_abs_diff"] <= reproduce.BPB_TOL, f"seed={seed}"
    rows[1]["per_window"][2] += 10 * reproduce.BPB_TOL
    out = reproduce.rerun_bpb(eng, bpb, 2)
    assert out["equal"] == 5 and [(r["context"], r["window"]) for r in out["rows"] if not r["equal"]] == [(200, 2)]

    with pytest.raises(gj.errors.ConfigError, match="only records of the shipped"):
        reproduce.engine_for({"name": "x", "model": "RANDOMLY INITIALISED model", "engine": {}}, 128)
    with pytest.raises(gj.errors.ConfigError, match="split=None"):
        reproduce.rerun_needle(eng, {**record, "split": None}, 2)
    with pytest.raises(gj.errors.ConfigError, match="'exactness' record"):
        reproduce.rerun({"name": "e", "study": "exactness"}, 2)


class _BitsPerTokenScorer:
    """Every scored token costs exactly `bits` bits (a log-prob of -bits * ln 2)."""

    def __init__(self, bits: float):
        self.bits, self.seen = bits, []

    def score(self, prompts, continuations):
        self.seen += list(zip(prompts, continuations))
        return SimpleNamespace(tokens=[np.full(len(c), -self.bits * np.log(2)) for c in continuations])


def test_bits_per_byte_with_a_bpe_tokenizer_counts_the_bytes_its_tokens_span():
    """A non-byte tokenizer: windows of `context` tokens of real held-out text, the last `scored`
    tokens scored, bits per byte = the tail's bits over the UTF-8 bytes its tokens decode to."""
    from gemini_jax.eval.heldout import heldout_text

    path = gj.pretrained_path("smollm2-135m-instruct")  # the tokenizer only: no weights are read
    tok = gj.GGUFTokenizer(path)
    seed, bits = 5, float(np.random.default_rng(5).uniform(0.5, 3.0))
    scorer = _BitsPerTokenScorer(bits)
    out = perplexity(scorer, 300, windows=3, scored=40, draw=Draw("test", seed), tokenizer=tok)
    text = bytes(heldout_text().astype(np.uint8)).decode("utf-8", errors="ignore")
    assert out["unit"] == "token" and len(out["per_window"]) == 3
    for (prompt, tail), got in zip(scorer.seen, out["per_window"]):
        assert len(prompt) + len(tail) == 300 and len(tail) == 40, f"seed={seed}"
        window = tok.decode(prompt + tail)
        assert window in text, f"seed={seed}: a window is not a stretch of the held-out text"
        tail_bytes = len(window.encode()) - len(tok.decode(prompt).encode())
        assert 40 < tail_bytes < 40 * 8, f"seed={seed}: {tail_bytes} bytes for 40 tokens"
        assert got == pytest.approx(40 * bits / tail_bytes, rel=1e-12), f"seed={seed}"
    again = perplexity(_BitsPerTokenScorer(bits), 300, windows=3, scored=40, draw=Draw("test", seed), tokenizer=tok)
    assert again["per_window"] == out["per_window"], "the same draw gives the same windows"
