"""A/B of the benchmark rows between two commits on this machine: is the new code slower?

    python experiments/bench_ab.py --base 6da3a2a [--rows paged_vs_contiguous,tiers] [--rounds 3] [--full]
    python experiments/bench_ab.py --base 6da3a2a --outputs   # greedy tokens and counters, not times

The base commit is checked out into a temporary git worktree (removed afterwards). Each round
runs `experiments/bench.py` once on each side, in separate processes, the order alternating
between rounds so drifting background load lands on both; each side runs its own tree's
bench code (the same measurements, adapted to its own API). For every timing a row reports
(record fields ending in `seconds_median`, matched by the record's non-timing fields), the ratio
new / old per round; a row's figure is the median over its timings of the median over rounds,
with the worst timing beside it. A row is slower when that figure passes `--tolerance` (5%).

Absolute times from separate processes are noisy on a shared machine; that is why every
timing is a ratio of runs made back to back, and several rounds are taken.

Writes experiments/results/bench_ab/<name>.json and .md (command, both commits, rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "bench_ab")


def git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_bench(tree: str, rows: str, full: bool, out: str) -> dict:
    """One bench.py run of `tree` (its own package first on sys.path) -> its bench.json."""
    cmd = [sys.executable, os.path.join(tree, "experiments", "bench.py"), "--rows", rows, "--out", out]
    if not full:
        cmd.append("--quick")
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.py failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "bench.json")) as fh:
        return json.load(fh)


def timings(bench: dict) -> dict:
    """{(row, record identity, field): seconds} for every `*seconds_median` of every record."""
    out = {}
    for row, body in bench["rows"].items():
        for rec in body.get("records", []):
            ident = tuple(sorted((k, v) for k, v in rec.items()
                                 if isinstance(v, (str, int, bool)) and not isinstance(v, float)
                                 and "seconds" not in k and "ratio" not in k and "bytes" not in k))
            for k, v in rec.items():
                if k.endswith("seconds_median") and isinstance(v, (int, float)) and v > 0:
                    out[(row, ident, k)] = float(v)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare against (e.g. main before a change)")
    p.add_argument("--rows", default=None, help="comma-separated bench rows (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--full", action="store_true", help="full sizes (default: bench.py --quick)")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--name", default=None, help="result file name (default: <base>_<head>)")
    p.add_argument("--outputs", action="store_true", help="compare greedy tokens and counters instead "
                   "(gemini_jax/bench/same_outputs.py on each tree)")
    a = p.parse_args(argv)
    base, head = git("rev-parse", a.base), git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    rows = a.rows
    if rows is None:  # every row the new side knows (bench.py's own default)
        rows = subprocess.run([sys.executable, os.path.join(HERE, "bench.py"), "--list-rows"], check=True,
                              capture_output=True, text=True).stdout.split()
        rows = ",".join(rows)
    work = tempfile.mkdtemp(prefix="bench_ab_")
    base_tree = os.path.join(work, "base")
    git("worktree", "add", "--detach", base_tree, base)
    per_round: list[dict] = []
    try:
        if a.outputs:
            return same_outputs(a, (base, head, dirty), base_tree, work)
        for r in range(a.rounds):
            sides = [("old", base_tree), ("new", ROOT)]
            if r % 2:
                sides.reverse()
            got = {}
            for side, tree in sides:
                print(f"round {r + 1}/{a.rounds}: {side} ({tree})", flush=True)
                got[side] = timings(run_bench(tree, rows, a.full, os.path.join(work, f"{side}{r}")))
            per_round.append(got)
    finally:
        git("worktree", "remove", "--force", base_tree)
        shutil.rmtree(work, ignore_errors=True)
    keys = sorted(set.intersection(*(set(g["old"]) & set(g["new"]) for g in per_round)), key=str)
    ratios = {k: statistics.median(g["new"][k] / g["old"][k] for g in per_round) for k in keys}
    table = []
    for row in rows.split(","):
        mine = {k: v for k, v in ratios.items() if k[0] == row}
        if not mine:
            table.append({"row": row, "timings": 0, "median_ratio": None, "worst_ratio": None, "slower": None})
            continue
        med = statistics.median(mine.values())
        worst = max(mine, key=mine.get)
        table.append({"row": row, "timings": len(mine), "median_ratio": med, "worst_ratio": mine[worst],
                      "worst_timing": f"{worst[2]} {dict(worst[1])}", "slower": med > 1 + a.tolerance})
    name = a.name or f"{base[:7]}_{head[:7]}"
    os.makedirs(RESULTS, exist_ok=True)
    record = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
              "commit": head + ("+dirty" if dirty else ""), "config": vars(a), "split": None, "seeds": [0], "base": base,
              "head": head + ("+dirty" if dirty else ""), "rounds": a.rounds, "mode": "full" if a.full else "quick",
              "tolerance": a.tolerance, "rows": table,
              "timings": [{"row": k[0], "record": dict(k[1]), "field": k[2], "new_over_old": v,
                           "per_round": [g["new"][k] / g["old"][k] for g in per_round]} for k, v in ratios.items()]}
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    lines = [f"# Bench A/B: {head[:7]}{'+dirty' if dirty else ''} (new) vs {base[:7]} (old)", "",
             f"`{record['command']}` — {a.rounds} rounds, bench.py {'full' if a.full else '--quick'} sizes, "
             f"sides alternating; per timing the median over rounds of new / old, per row the median over its "
             f"timings (worst beside it). Goal: no row slower by more than {a.tolerance:.0%}.", "",
             "| row | timings | new / old (median) | worst timing | met |", "| --- | --- | --- | --- | --- |"]
    for t in table:
        if t["median_ratio"] is None:
            lines.append(f"| {t['row']} | 0 | – | – | – |")
        else:
            lines.append(f"| {t['row']} | {t['timings']} | {t['median_ratio']:.3f} | {t['worst_ratio']:.3f} "
                         f"({t['worst_timing']}) | {'✗' if t['slower'] else '✓'} |")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def same_outputs(a, commits: tuple, base_tree: str, work: str) -> int:
    from gemini_jax.bench.same_outputs import compare

    (base, head, dirty), got = commits, {}
    for side, tree in (("old", base_tree), ("new", ROOT)):
        print(f"outputs: {side} ({tree})", flush=True)
        out = os.path.join(work, f"{side}.json")
        subprocess.run([sys.executable, os.path.join(ROOT, "gemini_jax", "bench", "same_outputs.py"), out], cwd=tree,
                       env=dict(os.environ, PYTHONPATH=tree), check=True)
        with open(out) as fh:
            got[side] = json.load(fh)
    rows, lines = compare(got["old"], got["new"])
    name, new = a.name or f"{base[:7]}_{head[:7]}_outputs", head + ("+dirty" if dirty else "")
    record = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), "commit": new,
              "config": {**vars(a), "text": "heldout"}, "split": None, "seeds": [got["new"]["seed"]], "base": base, "head": new,
              "cases": rows, "all_same": all(r["same"] for r in rows)}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    lines = [f"# Same outputs: {new[:7]} (new) vs {base[:7]} (old)", "", f"`{record['command']}`: greedy tokens and "
             f"integer counters of each engine, on held-out text, seed {record['seeds'][0]}.", "", *lines]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if record["all_same"] else 1


if __name__ == "__main__":
    sys.exit(main())
