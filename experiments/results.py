"""`make results [SUBSET=name]`: regenerate the results tables of docs/results.md, one named subset at a time.

    python experiments/results.py --list                 # the subsets, their jobs, rough CPU times
    python experiments/results.py needle                 # run every job of a subset (long: see --list)
    python experiments/results.py needle --missing       # only jobs whose record file is absent
    python experiments/results.py --render               # rewrite docs/results.md's generated tables
    python experiments/results.py --stale                # records measured on other code than HEAD's
    python experiments/results.py --reproduce needle/rerank_8k_test --sample 10   # rerun a record's trials here
    python experiments/results.py --report ablate_block_size   # an ablation sweep's table + plots (or a sweep dir)

Each job is an `experiments/run.py` (or `bench.py`, ...) command; it writes its record (command, config, commit, split,
seeds, records) under experiments/results/. `--render` rebuilds the blocks of docs/results.md
between `<!-- results:NAME -->` and `<!-- /results:NAME -->` from those files alone, so a table
there is never typed by hand; tests/test_results_files.py checks that those blocks are what the
committed files render to.

Knobs were chosen on dev trials; docs/results.md reports test trials, with dev beside them
(gemini_jax.eval.trials).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from gemini_jax.errors import ConfigError
from gemini_jax.eval.record import adds_only_definitions, same_installs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
DEPTHS10 = "[0.05,0.15,0.25,0.35,0.45,0.55,0.65,0.75,0.85,0.95]"
DEPTHS5 = "[0.1,0.3,0.5,0.7,0.9]"


@dataclass(frozen=True)
class Job:
    record: str          # <study>/<name>: the record file stem under experiments/results/
    overrides: tuple     # the script's arguments (experiments/run.py: Hydra overrides)
    minutes: int         # rough CPU minutes on a 2-core machine (for --list)
    script: str = "run.py"  # under experiments/

    @property
    def path(self) -> str:
        return os.path.join(RESULTS, self.record + ".json")

    @property
    def source(self) -> str | None:
        """The record a `--reproduce` job reruns a sample of (None: any other job)."""
        return self.overrides[1] if self.overrides[:1] == ("--reproduce",) else None


def _needle(name, preset, length, trials, split, minutes, depths=DEPTHS10):
    lengths = f"[{length}]" if isinstance(length, int) else length
    return Job(f"needle/{name}", ("experiment=needle", f"sparse={preset}", f"experiment.lengths={lengths}",
                                  f"experiment.depths={depths}", f"experiment.trials={trials}",
                                  f"experiment.split={split}", f"experiment.out_name={name}"), minutes)


def _smollm2_trials(name: str) -> tuple[str, ...]:
    """SmolLM2's needle trials: test, 2 per depth at 5 depths; dev (a knob to choose), 1 at 3 depths."""
    if name.endswith("_dev"):
        return "experiment.depths=[0.1,0.5,0.9]", "experiment.trials=1", "experiment.split=dev"
    return f"experiment.depths={DEPTHS5}", "experiment.trials=2", "experiment.split=test"


def _bpb(name, preset, contexts, split, minutes):
    return Job(f"perplexity/{name}", ("experiment=perplexity", f"sparse={preset}", f"experiment.contexts={contexts}",
                                      "experiment.windows=32", "experiment.scored=1024", f"experiment.split={split}",
                                      f"experiment.out_name={name}"), minutes)


# dev: the trials the presets were tuned on (seed 0, the grids' earlier derivation: 10 depths x 10
# trials at 8K, x 5 at 32K); test: fresh trials, twice as many.
SUBSETS: dict[str, list[Job]] = {
    "needle": [
        _needle("rerank_8k_test", "extrapolate_rerank", 8192, 20, "test", 11),
        _needle("rerank_32k_test", "extrapolate_rerank", 32768, 10, "test", 22),
        _needle("extrapolate_8k_test", "extrapolate", 8192, 20, "test", 10),
        _needle("extrapolate_32k_test", "extrapolate", 32768, 10, "test", 20),
        _needle("rerank_8k_dev", "extrapolate_rerank", 8192, 10, "dev", 6),
        _needle("rerank_32k_dev", "extrapolate_rerank", 32768, 5, "dev", 11),
        _needle("extrapolate_8k_dev", "extrapolate", 8192, 10, "dev", 5),
        _needle("extrapolate_32k_dev", "extrapolate", 32768, 5, "dev", 10),
        _needle("dense_test", "off", "[1024,2048,4096,8192]", 10, "test", 12, depths=DEPTHS5),
    ],
    "bpb": [
        _bpb("bpb_extrapolate_test", "extrapolate", "[2048,4096,8192,16384,32768]", "test", 35),
        _bpb("bpb_dense_test", "off", "[2048,4096,8192]", "test", 12),
        _bpb("bpb_extrapolate_dev", "extrapolate", "[2048,4096,8192,16384,32768]", "dev", 35),
        _bpb("bpb_dense_dev", "off", "[2048,4096,8192]", "dev", 12),
    ],
    "fullstack": [Job("fullstack/make_run", (), 3),
                  Job("fullstack/make_run_dense", ("engine.sparse.enabled=false", "experiment.out_name=make_run_dense"), 3)],
    # SmolLM2-135M-Instruct (the pretrained GGUF): chat-prompt needle on the same test trials, dense and sparse
    # up to 8000 tokens (its trained window is 8192: the prompt and the answer stay inside it), and int8 KV
    # against dense float32 on the trials they share (1K-4K).
    "smollm2": [Job(f"needle/smollm2_{name}", ("model=smollm2_135m", "experiment=needle", *over,
                                               f"experiment.lengths={lengths}", *_smollm2_trials(name),
                                               f"experiment.out_name=smollm2_{name}"), minutes)
                for name, over, lengths, minutes in (
                    ("dense_test", ("sparse=off",), "[1024,2048,4096,8000]", 35),
                    ("quest1024_test", ("sparse=quest", "engine.sparse.budget=1024"), "[1024,2048,4096,8000]", 35),
                    # Budgets 512 and 2048 (2048 covers the whole context at 1K and 2K: only 4K and 8,000).
                    ("quest512_test", ("sparse=quest", "engine.sparse.budget=512"), "[1024,2048,4096,8000]", 35),
                    ("quest2048_test", ("sparse=quest", "engine.sparse.budget=2048"), "[4096,8000]", 25),
                    # Mean digests (chosen on dev trials: needle_diagnose) where minmax fails, at the same budget.
                    ("quest1024_mean_test", ("sparse=quest", "engine.sparse.budget=1024", "engine.sparse.digest=mean"),
                     "[4096,8000]", 25),
                    ("int8_dense_test", ("sparse=off", "engine.cache.dtype=int8"), "[1024,2048,4096]", 15),
                    # Past its trained window: compact positions + rerank, the preset's budget (1536, tuned on
                    # the 2K-trained tiny model) and one that fills half of SmolLM2's 8K window (dev trials).
                    ("rerank16k_b1536_dev", ("sparse=extrapolate_rerank",), "[16384]", 9),
                    ("rerank16k_b4096_dev", ("sparse=extrapolate_rerank", "engine.sparse.budget=4096"), "[16384]", 9),
                    ("rerank16k_b4096_mean_dev", ("sparse=extrapolate_rerank", "engine.sparse.budget=4096",
                                                  "engine.sparse.digest=mean"), "[16384]", 11),
                    ("rerank_b4096_mean_test", ("sparse=extrapolate_rerank", "engine.sparse.budget=4096",
                                                "engine.sparse.digest=mean"), "[16384,32768]", 110))]
    # Bits per byte on held-out text (windows of 2048 tokens, the last 256 scored), float32 KV and the two
    # quantized ones on the same windows: paired per window by results_tables.smollm2_bpb_block.
    + [Job(f"perplexity/smollm2_bpb_{tag}_test", ("model=smollm2_135m", "experiment=perplexity", "sparse=off",
                                                  *over, "experiment.contexts=[2048]", "experiment.windows=32",
                                                  "experiment.scored=256", "experiment.split=test",
                                                  f"experiment.out_name=smollm2_bpb_{tag}_test"), 8)
       for tag, over in (("f32", ()), ("int8", ("engine.cache.dtype=int8",)),
                         ("fp8", ("engine.cache.dtype=float8_e4m3fn",)))]
    # int8 and fp8 KV against float32 on the needle, decided on >= 300 pairs: 1K and 2K, 5 depths x 30 trials each.
    + [Job(f"needle/smollm2_{tag}_pairs_test", ("model=smollm2_135m", "experiment=needle", "sparse=off", *over,
                                                "experiment.lengths=[1024,2048]", f"experiment.depths={DEPTHS5}",
                                                "experiment.trials=30", "experiment.batch=5", "engine.max_batch=5",
                                                "experiment.split=test", f"experiment.out_name=smollm2_{tag}_pairs_test"), 30)
       for tag, over in (("f32", ()), ("int8", ("engine.cache.dtype=int8",)),
                         ("fp8", ("engine.cache.dtype=float8_e4m3fn",)))]
    # The RULER-style tasks through its chat template, dense and sparse fixed at 1K / 2K (conf/ruler_grid_smollm2.yaml)
    + [Job("ruler/smollm2_grid", ("--config-name", "ruler_grid_smollm2"), 40, script="ruler_grid.py"),
       # and at 4K / 8,000 tokens (hours, resumable: its journal keeps each finished cell); then top-p (top_p chosen
       # on dev trials first) and compact + rerank beside each, on the cells where dense reached 50%.
       Job("ruler/smollm2_grid_long", ("--config-name", "ruler_grid_smollm2_long"), 240, script="ruler_grid.py"),
       *(Job(f"ruler/{name}", ("--config-name", f"ruler_grid_smollm2_methods{tail}", *extra), minutes, script="ruler_grid.py")
         for name, tail, extra, minutes in (("calibration_smollm2", "", ("calibrate=true",), 20),
                                            ("smollm2_grid_methods", "", (), 15), ("smollm2_grid_methods_long", "_long", (), 10)))],
    "exactness": [Job("exactness/exactness", ("experiment=exactness",), 4)],
    # Decode over tiers: emulated links (share x depth x link) and the earlier tiers row (bench rows).
    "tiers": [Job("bench_tiers/bench", ("--rows", "tiers_link,tiers", "--out", "experiments/results/bench_tiers"), 30,
                  script="bench.py"),
              # The paths users call: generate and a Session over tiers, per token, at 16K.
              Job("tiers_generate/tiers_generate", (), 8, script="tiers_generate.py")],
    # Persistent prefixes across processes: time to first token of a 32K prompt, cold vs loaded.
    "prefix": [Job("persistent_prefix/persistent_prefix", (), 4, script="persistent_prefix.py")],
    # Serving over loopback HTTP: 1 / 4 / 16 / 64 streams of 4K prompts, dense vs sparse, a tenant flood.
    "serve": [Job("serve_load/serve_load", (), 25, script="serve_load.py"),
              # 16 streams against the server before one decode core (19ca6da: one token a decode call).
              Job("serve_load/serve_ab", ("--levels", "16", "--skip-flood", "--baseline", "19ca6da"), 30,
                  script="serve_load.py")],
    # k tokens per device program against transformers and the bandwidth bound (bench rows).
    # Code as syntax: the node encoder trained and measured on held-out programs and real files.
    "code": [Job("code/node_distances", (), 2, script="train_code_encoder.py")],
    # Syntax-aligned vs fixed KV pages on held-out Python at one sparse budget: needle (paired) and digest recall.
    "align": [Job("align_pages/align_pages", ("experiment=align_pages",), 20)],
    # Image encoders plugged into the frozen decoder by trained projectors: held-out digits.
    "encoders": [Job("encoders/digits", (), 5, script="train_encoders.py")],
    # RULER-style tasks: top_p chosen on dev trials at sparse fixed's KV bytes, then the grid on test trials
    # (task x length x dense / sparse fixed / sparse top-p / compact + rerank, the shipped and retrained models).
    "ruler": [Job("ruler/calibration", ("calibrate=true",), 10, script="ruler_grid.py"),
              Job("ruler/grid", (), 50, script="ruler_grid.py")],
    "decode": [Job("bench_decode/bench", ("--rows", "decode_steps_vs_hf,decode_bandwidth",
                                          "--out", "experiments/results/bench_decode"), 35, script="bench.py"),
               # The pretrained model against transformers on the same GGUF, as a fraction of the bound.
               Job("bench_smollm2/bench", ("--rows", "smollm2_decode", "--out", "experiments/results/bench_smollm2"),
                   15, script="bench.py"),
               # Where a batch-1 step's time goes at 2K and 16K: a profiler trace, attention against the rest.
               Job("bench_profile/bench", ("--rows", "decode_profile", "--out", "experiments/results/bench_profile"),
                   5, script="bench.py")],
}
# Quantized KV on the test trials the float32 records hold (the first trials of each cell, the first
# windows of each context: the same prompts), paired with them by results_tables.kv_quant_block.
def _quant(dtype: str, tag: str) -> list[Job]:
    over = f"engine.cache.dtype={dtype}"
    jobs = [_needle(f"{tag}_rerank_8k_test", "extrapolate_rerank", 8192, 20, "test", 12),
            _needle(f"{tag}_rerank_32k_test", "extrapolate_rerank", 32768, 5, "test", 11),
            _needle(f"{tag}_dense_test", "off", "[1024,2048,4096]", 10, "test", 5, depths=DEPTHS5)]
    bpb = _bpb(f"bpb_{tag}_extrapolate_test", "extrapolate", "[2048,4096,8192,16384,32768]", "test", 10)
    bpb = Job(bpb.record, tuple(o.replace("windows=32", "windows=8") for o in bpb.overrides), bpb.minutes)
    return [Job(j.record, (*j.overrides, over), j.minutes) for j in (*jobs, bpb)]


SUBSETS["kv_quant"] = [*_quant("int8", "int8"), *_quant("float8_e4m3fn", "fp8"),
                       Job("bench_kv_quant/bench", ("--rows", "kv_quant", "--out", "experiments/results/bench_kv_quant"),
                           6, script="bench.py")]
# A sample of each needle / bits-per-byte record rerun at the current commit, trial by trial
# (`--reproduce`, gemini_jax.eval.reproduce): minutes instead of the hours a full rerun of those subsets takes.
# 6 needle trials per record, 2 windows per context; the quantized records (which hold fewer) 4 and 1.
_REPRODUCED = [(j, 6 if j.record.startswith("needle/") else 2) for j in (*SUBSETS["needle"], *SUBSETS["bpb"])]
_REPRODUCED += [(j, 4 if j.record.startswith("needle/") else 1) for j in SUBSETS["kv_quant"]
                if j.script == "run.py"]
SUBSETS["reproduce"] = [
    Job(f"reproduce/{j.record.replace('/', '_')}", ("--reproduce", j.record, "--sample", str(n)),
        4 if "32k" in j.record or "extrapolate" in j.record and j.record.startswith("perplexity/") else 2,
        script="results.py")
    for j, n in _REPRODUCED]

# What a record's figures depend on: a commit that changes none of these leaves every record valid.
# A record that lists the files its job ran (`code`, gemini_jax.eval.record.code_files) depends on
# those and on ALWAYS (configs, dependencies, the shipped model); an older record on all of CODE_PATHS.
CODE_PATHS = ("gemini_jax", "conf", "experiments/*.py", "experiments/benchlib", "pyproject.toml")
ALWAYS = ("conf", ":(exclude)conf/train_tiny*.yaml", "pyproject.toml", "gemini_jax/assets/tiny")  # the LM
# training configs are read by experiments/train_tiny.py alone, which no measurement runs; the code
# and image encoders' weights (gemini_jax/assets/code_encoder, assets/encoders) are their records' output


def _changed_since(commit: str, code: list[str] | None = None, experiment: str | None = None) -> int:
    """Files the record depends on (its `code` and ALWAYS; CODE_PATHS when `code` is None) that
    differ between `commit` and HEAD (-1: a commit this clone lacks). Files added since do not
    count: a record cannot have run what did not exist, and wiring a new file in changes one that
    did. pyproject.toml counts only when what it installs changed (`same_installs`). With
    `experiment` (the one its run selected, `_experiment_of`), the files of other experiments
    under conf/experiment/ do not count: Hydra reads the selected one and what it names."""
    paths = CODE_PATHS if code is None else (*ALWAYS, *code)
    diff = subprocess.run(["git", "diff", "--name-only", "--diff-filter=a", commit, "HEAD", "--", *paths], cwd=ROOT,
                          capture_output=True, text=True)
    if diff.returncode != 0 or not commit:
        return -1
    files = [f for f in diff.stdout.split() if not (f.endswith(".py") and _only_adds_definitions(commit, f))
             and not _unread_experiment(f, experiment)]
    if "pyproject.toml" in files:
        old = subprocess.run(["git", "show", f"{commit}:pyproject.toml"], cwd=ROOT, capture_output=True, text=True)
        with open(os.path.join(ROOT, "pyproject.toml")) as fh:
            if old.returncode == 0 and same_installs(old.stdout, fh.read()):
                files.remove("pyproject.toml")
    return len(files)


def _experiment_of(job: "Job") -> str | None:
    """The experiment (conf/experiment/<name>.yaml) a job's run selects: run.py's `experiment=`
    override, or for a reproduction the reproduced job's. None: not known (every file counts)."""
    if job.source:
        target = next((j for jobs in SUBSETS.values() for j in jobs if j.record == job.source), None)
        return None if target is None else _experiment_of(target)
    if job.script != "run.py":
        return None
    return next((o.split("=", 1)[1] for o in job.overrides if o.startswith("experiment=")), None)


def _unread_experiment(path: str, experiment: str | None) -> bool:
    """Whether `path` is the file of another experiment than `experiment`, one its own file does not
    name (a defaults list naming a base, e.g. ablate_base)."""
    folder = "conf/experiment/"
    if experiment is None or not path.startswith(folder) or not path.endswith(".yaml"):
        return False
    name = path[len(folder):-len(".yaml")]
    if name == experiment:
        return False
    try:
        with open(os.path.join(ROOT, folder, experiment + ".yaml")) as fh:
            return re.search(rf"\b{re.escape(name)}\b", fh.read()) is None
    except OSError:
        return False


def _only_adds_definitions(commit: str, path: str) -> bool:
    """Whether HEAD's `path` is its `commit` text plus new top-level functions or classes (no
    decorators, names the old module did not bind), every old statement kept as it was and in
    order: what ran then runs the same now (a new error class, a new public helper). Docstrings
    and comments do not count: rewording what a knob means measures nothing new."""
    texts = [subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
             for rev in (commit, "HEAD")]
    return all(t.returncode == 0 for t in texts) and adds_only_definitions(texts[0].stdout, texts[1].stdout)


def stale_records() -> list[tuple[str, str, str]]:
    """(record, its commit, why) for every record measured on other code than HEAD's. A needle or
    bits-per-byte record whose sample was rerun on HEAD's code, every trial the same, is not stale:
    the reproduction stands for it (a full rerun takes hours)."""
    import json

    def commit_of(job):
        with open(job.path) as fh:
            rec = json.load(fh)
        return rec.get("commit", ""), rec.get("code"), _experiment_of(job)

    reproduced = {}
    for job in SUBSETS["reproduce"]:
        if os.path.exists(job.path) and _changed_since(*commit_of(job)) == 0:
            with open(job.path) as fh:
                o = json.load(fh)["outcome"]
            reproduced[job.source] = o["equal"] == o["checked"]
    out = []
    for jobs in SUBSETS.values():
        for job in jobs:
            if not os.path.exists(job.path):
                continue
            commit, code, experiment = commit_of(job)
            n = _changed_since(commit, code, experiment)
            if n == 0 or reproduced.get(job.record):
                continue
            why = "commit not in this clone" if n < 0 else f"{n} code file(s) changed since"
            if job.record in reproduced:
                why += "; its reproduction on HEAD's code differs"
            out.append((job.record, commit, why))
    return out


def run_subset(name: str, *, missing_only: bool, stale_only: bool = False) -> int:
    jobs = SUBSETS[name]
    failed = 0
    for i, job in enumerate(jobs, 1):
        if missing_only and os.path.exists(job.path):
            print(f"[{name} {i}/{len(jobs)}] {job.record}: record exists, skipped (--missing)", flush=True)
            continue
        # Asked per job: a reproduction run just before can make a needle record current.
        if stale_only and os.path.exists(job.path) and job.record not in {r for r, _, _ in stale_records()}:
            print(f"[{name} {i}/{len(jobs)}] {job.record}: current at HEAD, skipped (--stale-only)", flush=True)
            continue
        cmd = [sys.executable, os.path.join(ROOT, "experiments", job.script), *job.overrides]
        if job.script == "run.py":  # a plain run writes into its own output directory; these are the records
            cmd.append("results_dir=experiments/results")
        print(f"[{name} {i}/{len(jobs)}] {job.record} (~{job.minutes} min): {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"[{name} {i}/{len(jobs)}] {job.record}: exit {rc} after {(time.perf_counter() - t0) / 60:.1f} min",
              flush=True)
        failed += rc != 0
    return failed


def reproduce(record: str, sample: int, argv: list[str]) -> int:
    """Rerun `sample` trials of a committed needle / bits-per-byte record at this commit; write
    experiments/results/reproduce/<study>_<name>.{json,md}. Exit 1 when one differs."""
    import json

    from gemini_jax.eval.record import StudyResult, make_record, write_record
    from gemini_jax.eval.reproduce import markdown, rerun

    path = os.path.join(RESULTS, record + ".json")
    if not os.path.exists(path):
        raise ConfigError(f"no record {path}")
    with open(path) as fh:
        source = json.load(fh)
    outcome = rerun(source, sample)
    print(f"{record}: {outcome['equal']}/{outcome['checked']} trials reproduce"
          + (f", max |Δ| {outcome['max_abs_diff']:.2e}" if outcome["kind"] == "bpb" else ""))
    for row in outcome["rows"]:
        if not row["equal"]:
            print(f"  differs: {row}")
    study, name = record.split("/", 1)
    rec = make_record("reproduce", StudyResult(
        name=f"{study}_{name}", records=outcome["rows"], split=source["split"], seeds=source["seeds"],
        extra={"source": record, "source_commit": source["commit"],
               "outcome": {k: v for k, v in outcome.items() if k != "rows"}}),
        command="python experiments/results.py " + " ".join(argv), config={"record": record, "sample": sample})
    paths = write_record(RESULTS, rec, markdown(rec))
    print(f"written {os.path.relpath(paths['json'], ROOT)}")
    return 0 if outcome["equal"] == outcome["checked"] else 1


# A sweep small enough to run where none is on disk (notebook 02, the tests): every phase of an ablation
# job (decode timing, needle, bits per byte) shrunk to a few seconds, two block sizes.
SMALL_WORKLOAD = (
    "experiment.workload.prompt_tokens=64", "experiment.workload.decode_tokens=8",
    "experiment.workload.decode_repeats=2", "experiment.workload.needle_length=128",
    "experiment.workload.needle_trials=2", "experiment.workload.bpb_context=128",
    "experiment.workload.bpb_windows=1", "experiment.workload.bpb_scored=16", "engine.max_seq_len=256",
)
SMALL_SWEEP = ("experiment=ablate_block_size", "engine.cache.block_size=16,64")


def run_small_sweep(out_dir: str) -> str:
    """Run `ablate.py --multirun` over SMALL_SWEEP at SMALL_WORKLOAD sizes into `out_dir/sweep` (wandb
    offline under out_dir unless WANDB_MODE says otherwise) and return that sweep directory. About a
    minute on 2 CPU cores; the figures are a demonstration of the tooling, not measurements."""
    sweep = os.path.join(out_dir, "sweep")
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "offline"), WANDB_SILENT="true")
    for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env.setdefault(key, os.path.join(out_dir, key.lower()))
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "ablate.py"), "--multirun", *SMALL_SWEEP,
           *SMALL_WORKLOAD, f"hydra.sweep.dir={sweep}", f"wandb.dir={os.path.join(out_dir, 'wandb')}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"ran a small sweep in {time.perf_counter() - t0:.0f} s: python experiments/ablate.py --multirun "
          f"{' '.join(SMALL_SWEEP)} (toy sizes) -> {sweep}")
    return sweep


def report(target: str, results_dir: str) -> int:
    """An ablation sweep's REPORT.md and plots, written beside its JSON files (gemini_jax.eval.sweeps)."""
    from gemini_jax.eval import sweeps

    sweep_dir = sweeps.find_sweep(target, results_dir)
    paths = sweeps.write_report(sweep_dir)
    with open(paths["md"]) as fh:
        print(fh.read())
    print(f"report: wrote {paths['md']}")
    print(f"report: plots {', '.join(os.path.basename(v) for k, v in paths.items() if k != 'md')} in {sweep_dir}")
    return 0


def main(argv=None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as err:  # one line, no traceback
        print(f"results: {err}", file=sys.stderr)
        return 1


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("subsets", nargs="*", help=f"named subsets ({', '.join(SUBSETS)}; 'all' for every one)")
    ap.add_argument("--list", action="store_true", help="list subsets and jobs, run nothing")
    ap.add_argument("--missing", action="store_true", help="run only jobs whose record file is absent")
    ap.add_argument("--render", action="store_true", help="rewrite docs/results.md's generated tables from the files")
    ap.add_argument("--stale-only", action="store_true",
                    help="run only jobs whose record is absent or stale; the reproduce subset runs first, so a "
                         "needle or bits-per-byte record its sample reproduces is not rerun in full")
    ap.add_argument("--stale", action="store_true",
                    help="list records whose code (" + ", ".join(CODE_PATHS) + ") changed since they were measured")
    ap.add_argument("--reproduce", metavar="STUDY/NAME",
                    help="rerun a sample of a needle or bits-per-byte record's trials at this commit")
    ap.add_argument("--sample", type=int, default=10,
                    help="--reproduce: needle trials to rerun, spread over the grid; bits per byte: windows per context")
    ap.add_argument("--report", metavar="SWEEP", help="an ablation sweep's table and plots: a sweep directory, or a "
                    "sweep name (its latest sweep under --results-dir/ablations/<name>/)")
    ap.add_argument("--results-dir", default=RESULTS, help="--report: where the sweeps were written")
    args = ap.parse_args(argv)
    if args.reproduce:
        return reproduce(args.reproduce, args.sample, argv)
    if args.report:
        return report(args.report, args.results_dir)
    if args.stale:
        stale = stale_records()
        for record, commit, why in stale:
            print(f"{record:<40} {commit[:7]}  {why}")
        print(f"{len(stale)} record(s) measured on other code than HEAD's")
        return 1 if stale else 0
    names = list(SUBSETS) if "all" in args.subsets else args.subsets
    unknown = [n for n in names if n not in SUBSETS]
    if unknown:
        ap.error(f"unknown subset(s) {unknown}; choose from {list(SUBSETS)} or 'all'")
    if args.list or not (names or args.render):
        for n, jobs in SUBSETS.items():
            print(f"{n} (~{sum(j.minutes for j in jobs)} min)")
            for j in jobs:
                print(f"  {j.record:<36} {'present' if os.path.exists(j.path) else 'absent ':<8} "
                      f"{j.script} {' '.join(j.overrides)}")
        return 0
    if args.stale_only and "reproduce" in names:
        names = ["reproduce", *[n for n in names if n != "reproduce"]]
    failed = sum(run_subset(n, missing_only=args.missing, stale_only=args.stale_only) for n in names)
    if args.render:
        from results_tables import DOC, render_file  # this script's directory is on sys.path

        changed = render_file(os.path.join(ROOT, DOC), RESULTS)
        print(f"{DOC}: {changed} generated table(s) rewritten")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

