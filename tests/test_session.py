"""Interruptible decoding: resume == fresh run, rewind, audit chain, budget, bad snapshots."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.errors import BudgetExceeded, ContextLengthError, SnapshotError, TokenError
from gemini_jax.session import verify
from gemini_jax.testing import logits_tolerance, random_model, random_prompts, tiny_config

GREEDY = dict(temperature=0.0, stop_at_eos=False)


def _engine(model, max_seq_len=192, **sparse):
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=max_seq_len, prefill_chunk=16, max_batch=2, cache=dict(block_size=8),
        sparse=sparse)))


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("llama"), 17)


def _near_tie_ok(eng, prefix, ours, ref):
    """Tokens equal, or the first difference is a float near-tie in the reference logits: two runs,
    each within the float bound of the reference, may order two logits closer than twice it either way."""
    if ours == ref:
        return True
    i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
    logits = np.asarray(gj.forward(eng.model, prefix + ref[:i + 1]))[len(prefix) + i - 1]
    tol = logits_tolerance(eng.model.cfg, context=len(prefix) + i + 1, reference=logits)
    return abs(logits[ours[i]] - logits[ref[i]]) <= 2 * tol


def test_resume_equals_fresh_run_50_cases(model, tmp_path):
    """Invariant 5 (greedy, fp32): resume(snapshot at t, I) == fresh run on prompt+gen[:t]+I;
    and with rewind_to == fresh run on (prompt+gen)[:r] + I. 50 seeded random cases."""
    seed = 50
    rng = np.random.default_rng(seed)
    eng = _engine(model)
    vocab = model.cfg.vocab_size
    for case in range(50):
        prompt = random_prompts(rng, vocab, (int(rng.integers(1, 40)),))[0]
        t = int(rng.integers(1, 12))
        instr = random_prompts(rng, vocab, (int(rng.integers(0, 12)),))[0]
        sess = eng.start(prompt, gj.SamplingParams(max_new_tokens=t, **GREEDY))
        gen = sess.run()
        path = str(tmp_path / f"s{case}")
        sess.snapshot(path)
        sess.close()
        rewind = None if case % 2 == 0 else int(rng.integers(1, len(prompt) + t + 1))
        n = int(rng.integers(1, 8))
        r = eng.resume(path, instr, rewind_to=rewind, params=gj.SamplingParams(max_new_tokens=n, **GREEDY))
        assert r.stats["prefill_tokens_computed"] == len(instr) + (1 if rewind is not None else 0)
        ours = r.run()
        r.close()
        prefix = (prompt + gen)[:rewind] + instr if rewind is not None else prompt + gen + instr
        ref = eng.generate(prefix, gj.SamplingParams(max_new_tokens=n, **GREEDY)).tokens
        assert _near_tie_ok(eng, prefix, ours, ref), f"seed={seed} case={case}"
    assert not eng.pages.seqs and eng.pages.pool.num_used == 0, "sessions leaked pages"


def test_sampled_resume_is_reproducible(model, tmp_path):
    eng = _engine(model)
    prompt = random_prompts(np.random.default_rng(1), model.cfg.vocab_size, (20,))[0]
    params = gj.SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20, seed=5, stop_at_eos=False)
    sess = eng.start(prompt, params)
    sess.run()
    sess.snapshot(str(tmp_path / "s"))
    sess.close()
    runs = []
    for _ in range(2):
        r = eng.resume(str(tmp_path / "s"), [1, 2, 3])
        runs.append(r.run())
        r.close()
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_interrupt_from_another_thread(model):
    eng = _engine(model, max_seq_len=512)
    sess = eng.start([1, 2, 3], gj.SamplingParams(max_new_tokens=400, **GREEDY))
    got = []
    timer = threading.Timer(0.5, sess.interrupt)
    timer.start()
    for tok in sess:
        got.append(tok)
    assert sess.interrupted and 0 < len(got) < 400
    assert sess.position == 3 + len(got)  # every yielded token's KV is in the cache
    sess.close()


def test_branches_share_pages(model, tmp_path):
    eng = _engine(model)
    sess = eng.start(random_prompts(np.random.default_rng(2), model.cfg.vocab_size, (40,))[0],
                     gj.SamplingParams(max_new_tokens=3, **GREEDY))
    sess.run()
    sess.snapshot(str(tmp_path / "s"))
    sess.close()
    a = eng.resume(str(tmp_path / "s"), [4, 5])
    used_one = eng.pages.pool.num_used
    b = eng.resume(str(tmp_path / "s"), [6, 7, 8])
    # The second branch shares every full page (5 of 43 tokens' pages) and owns only its last page.
    assert eng.pages.pool.num_used - used_one <= 2
    shared = set(eng.pages.seqs[a.seq_id].pages[:5]) & set(eng.pages.seqs[b.seq_id].pages[:5])
    assert len(shared) == 5
    a.close()
    b.close()
    assert eng.pages.pool.num_used == 0


def test_audit_chain_and_tamper(model, tmp_path):
    eng = _engine(model)
    sess = eng.start([5, 6, 7, 8], gj.SamplingParams(max_new_tokens=4, **GREEDY))
    sess.run()
    snap = str(tmp_path / "s")
    sess.snapshot(snap)
    sess.close()
    log = str(tmp_path / "audit.jsonl")
    for instr in ([9, 10], [11], [12, 13, 14]):
        r = eng.resume(snap, instr, audit_log=log, instruction_text=f"instr {instr}")
        r.run()
        r.close()
    assert verify(log) == (True, "3 record(s) verified")
    assert verify(log, eng)[0]
    lines = open(log).read().splitlines()
    rec = json.loads(lines[1])
    rec["instruction_text"] = "something else"
    lines[1] = json.dumps(rec, sort_keys=True)
    open(log, "w").write("\n".join(lines) + "\n")
    ok, msg = verify(log)
    assert not ok and msg.startswith("record 1:")
    # The CLI says the same and exits non-zero.
    out = subprocess.run([sys.executable, "-m", "gemini_jax.audit", "verify", log],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "record 1" in out.stdout


def test_bad_snapshots(model, tmp_path):
    eng = _engine(model)
    sess = eng.start([1, 2, 3, 4, 5], gj.SamplingParams(max_new_tokens=3, **GREEDY))
    sess.run()
    snap = tmp_path / "s"
    sess.snapshot(str(snap))
    sess.close()
    # Another model (different weights) and another config (block size) are refused, naming why.
    other = _engine(random_model(tiny_config("llama"), 999))
    with pytest.raises(SnapshotError, match="weights_sha256"):
        other.resume(str(snap), [1])
    other_cfg = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=192, cache=dict(block_size=16))))
    with pytest.raises(SnapshotError, match="block_size"):
        other_cfg.resume(str(snap), [1])
    # Tampered metadata.
    bad = tmp_path / "tampered"
    shutil.copytree(snap, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["tokens"][0] = 7
    (bad / "meta.json").write_text(json.dumps(meta, sort_keys=True))
    with pytest.raises(SnapshotError, match="seal"):
        eng.resume(str(bad), [1])
    # Truncated array files.
    trunc = tmp_path / "truncated"
    shutil.copytree(snap, trunc)
    for root, _, files in os.walk(trunc / "arrays"):
        for f in files:
            p = os.path.join(root, f)
            if os.path.getsize(p) > 64:
                with open(p, "r+b") as fh:
                    fh.truncate(os.path.getsize(p) // 2)
    with pytest.raises(SnapshotError):
        eng.resume(str(trunc), [1])
    # Unsealed (interrupted write).
    unsealed = tmp_path / "unsealed"
    shutil.copytree(snap, unsealed)
    os.remove(unsealed / "SEALED")
    with pytest.raises(SnapshotError, match="incomplete"):
        eng.resume(str(unsealed), [1])
    assert eng.pages.pool.num_used == 0


def test_bad_resume_requests_change_nothing(model, tmp_path):
    eng = _engine(model, max_seq_len=64)
    sess = eng.start(list(range(1, 30)), gj.SamplingParams(max_new_tokens=4, **GREEDY), budget=10_000)
    sess.run()
    sess.snapshot(str(tmp_path / "s"))
    sess.close()
    before = (eng.pages.pool.num_used, dict(eng.pages.seqs))
    with pytest.raises(ContextLengthError):
        eng.resume(str(tmp_path / "s"), list(range(40)))
    with pytest.raises(TokenError):
        eng.resume(str(tmp_path / "s"), [1, 2, 10_000])
    with pytest.raises(BudgetExceeded):
        eng.resume(str(tmp_path / "s"), [1, 2], budget=50)
    assert (eng.pages.pool.num_used, dict(eng.pages.seqs)) == before


def test_budget_stops_with_partial_result(model):
    eng = _engine(model)
    L = model.cfg.num_layers
    sess = eng.start([1, 2, 3, 4], gj.SamplingParams(max_new_tokens=50, **GREEDY), budget=(4 + 5) * L)
    got = []
    with pytest.raises(BudgetExceeded) as info:
        for tok in sess:
            got.append(tok)
    assert got == info.value.partial and len(got) == 5
    assert sess.compute_units == 9 * L
    sess.close()


CRASH_SCRIPT = textwrap.dedent('''
    import numpy as np
    import gemini_jax as gj
    from gemini_jax.testing import random_model, tiny_config
    model = random_model(tiny_config("llama"), 7)
    eng = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=192, prefill_chunk=16,
                    cache=dict(block_size=8))))
    sess = eng.start(list(range(1, 60)), gj.SamplingParams(max_new_tokens=3, temperature=0.0, stop_at_eos=False))
    sess.run()
    sess.snapshot({path!r})  # one sealed snapshot exists before the parent starts its clock
    print("ready", flush=True)
    while True:
        sess.snapshot({path!r})
''')


def _kill_during_snapshots(tmp_path, kills: int, seed: int):
    """SIGKILL a process that keeps re-snapshotting to one path; the path must always restore.

    The child seals one snapshot before it says "ready", so every kill lands while a sealed
    snapshot exists (and, after a random delay, most likely in the middle of replacing it):
    each kill must leave a snapshot that restores to the child's state and continues as a
    fresh run would."""
    path = str(tmp_path / "snap")
    model = random_model(tiny_config("llama"), 7)
    eng = _engine(model)
    prompt = list(range(1, 60))
    gen = eng.generate(prompt, gj.SamplingParams(max_new_tokens=3, **GREEDY)).tokens
    want = eng.generate(prompt + gen + [1, 2], gj.SamplingParams(max_new_tokens=2, **GREEDY)).tokens
    rng = np.random.default_rng(seed)
    killed_with_snapshot = restored = 0
    for k in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT.format(path=path)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout.readline().strip() == "ready", f"seed={seed} kill={k}: child never got ready"
        time.sleep(float(rng.uniform(0.05, 1.5)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"seed={seed} kill={k}: child exited {proc.returncode}"
        # A sealed snapshot existed before this kill: it (or its replacement) must still be there.
        assert os.path.exists(path), f"seed={seed} kill={k}: the kill left no snapshot at {path}"
        killed_with_snapshot += 1
        r = eng.resume(path, [1, 2], params=gj.SamplingParams(max_new_tokens=2, **GREEDY))
        assert r.tokens == prompt + gen + [1, 2], f"seed={seed} kill={k}"
        assert r.run() == want, f"seed={seed} kill={k}: the restored session continues differently"
        r.close()
        restored += 1
    assert killed_with_snapshot == restored == kills, (killed_with_snapshot, restored, kills)
    assert eng.pages.pool.num_used == 0


def test_kill_during_snapshot_leaves_restorable(tmp_path):
    _kill_during_snapshots(tmp_path, 3, seed=3)


@pytest.mark.slow
def test_kill_during_snapshot_20_times(tmp_path):
    _kill_during_snapshots(tmp_path, 20, seed=20)


@pytest.mark.slow
def test_soak_1000_cycles(model, tmp_path):
    """1,000 interrupt/snapshot/resume cycles: live pages stay bounded, RSS does not grow."""
    import resource

    eng = _engine(model)
    sess = eng.start([1, 2, 3], gj.SamplingParams(max_new_tokens=2, **GREEDY))
    sess.run()
    rss = []
    for i in range(1000):
        sess.snapshot(str(tmp_path / "s"))
        sess.close()
        sess = eng.resume(str(tmp_path / "s"), [], rewind_to=3, params=gj.SamplingParams(max_new_tokens=2, **GREEDY))
        sess.run()
        assert eng.pages.pool.num_used <= 1
        if i % 100 == 0:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    sess.close()
    assert eng.pages.pool.num_used == 0
    print("max RSS (KiB) every 100 cycles:", rss)
    assert rss[-1] - rss[1] < 200_000  # < 200 MB growth after warm-up


def test_killed_between_the_renames_of_a_replace_the_old_snapshot_still_restores(model, tmp_path):
    """Replacing a snapshot moves the old one aside, then renames the new one in. A process killed
    between the two leaves the state built here by hand; the old snapshot must still restore,
    and the next save clears what was left aside."""
    eng = _engine(model)
    sess = eng.start([5, 6, 7, 8], gj.SamplingParams(max_new_tokens=3, **GREEDY))
    sess.run()
    snap = tmp_path / "s"
    digest = sess.snapshot(str(snap))
    aside = tmp_path / ".s.tmp-0123abcd.old"
    os.rename(snap, aside)  # the first rename of a replace happened; the second never did
    restored = eng.resume(str(snap), [9])
    assert restored.snapshot_hash == digest and restored.tokens[:7] == sess.tokens
    restored.close()
    sess.snapshot(str(snap))  # a later save completes and removes the copy left aside
    assert snap.is_dir() and not aside.exists()
    sess.close()
