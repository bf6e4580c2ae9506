"""The benchmark report: every row measured side by side in ONE process.

    python experiments/bench.py                  # full sizes (long: pause other work first)
    python experiments/bench.py --quick          # tiny sizes, a 1-2 minute smoke test
    python experiments/bench.py --rows dense_vs_hf,kv_bytes --out /tmp/bench
    python experiments/bench.py --rows tier_layout --out /tmp/layout   # the disk tier's layouts
    python experiments/bench.py --list-rows

Writes `<out>/BENCH.md` and `<out>/bench.json` (default out: experiments/results/bench/), with a
description of the machine and its measured memory bandwidth.

Rules every row follows (docs/architecture.md §9): the headline is a RATIO of variants measured side by side
in this run, as the median of per-repeat ratios, with the variants interleaved inside each repeat
(order rotated) so background load lands on all of them; absolute times are printed alongside but
never compared across runs; compile/warm-up happens before timing.

Rows are registered in `gemini_jax/bench/rows/` (one module each, see
`gemini_jax/bench/registry.py` for how to add one). `--rows` selects a subset; rows that share a
measurement (`kv_bytes` reuses `paged_vs_contiguous`'s decode steps) compute it once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

from gemini_jax.eval.record import code_files, git_commit

from gemini_jax.bench.machine import describe_machine, measure_bandwidth
from gemini_jax.bench.registry import ROWS, Context
import gemini_jax.bench.rows  # noqa: F401  (registers the rows)

HERE = os.path.dirname(os.path.abspath(__file__))

NOTE = ("Figures below come from whatever machine ran this file — see **Machine**. On the shared "
        "2-core CPU used during development a training job and other processes compete for the same "
        "cores and memory bus: absolute times there are noisy and only the side-by-side ratios (and "
        "their min–max spread over repeats) are meaningful.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, ~1-2 minutes)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated rows to run, in report order (default: all = {','.join(ROWS)})")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench"), help="output directory")
    p.add_argument("--list-rows", action="store_true", help="print the row names, one per line, and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bw-mib", type=int, default=None,
                   help="array size for the bandwidth probe (default 128 quick / 512 full)")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; available: {list(ROWS)}")
    return args


def machine_markdown(m: dict, bw: dict) -> str:
    keys = [("CPU", m.get("cpu_model")), ("SIMD", ", ".join(m.get("simd", [])) or "-"),
            ("cores (logical / usable)", f"{m.get('logical_cpus')} / {m.get('usable_cpus')}"),
            ("L3", m.get("l3_cache")), ("RAM (total / available at start)",
                                        f"{m.get('ram_total_gib')} / {m.get('ram_available_gib')} GiB"),
            ("load average at start / end", f"{m.get('load_avg_at_start')} / {m.get('load_avg_at_end')}"),
            ("jax", f"{m.get('jax')} ({m.get('jax_backend')}: {', '.join(m.get('jax_devices', []))})"),
            ("flax / numpy", f"{m.get('flax')} / {m.get('numpy')}"),
            ("torch / transformers", f"{m.get('torch')} ({m.get('torch_threads')} threads) / "
                                     f"{m.get('transformers')}"),
            ("python / platform", f"{m.get('python')} / {m.get('platform')}"),
            ("git", f"{m.get('git_commit')}{' (gemini_jax/ has uncommitted changes)' if m.get('gemini_jax_dirty') else ''}"),
            ("memory bandwidth (reference)", f"**{bw['reference_gbs']:.1f} GB/s** ({bw['reference']})"),
            ("memory bandwidth (numpy copy)", f"{bw['numpy_copy_gbs']:.1f} GB/s")]
    lines = ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in keys]
    return "\n".join(lines) + f"\n\nBandwidth measurement: {bw['method']}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        print("\n".join(ROWS))
        return 0
    os.makedirs(args.out, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    t_start = time.perf_counter()
    print(f"bench: {'QUICK' if args.quick else 'FULL'} run of rows {args.rows}", flush=True)
    machine = describe_machine()
    bw_mib = args.bw_mib or (128 if args.quick else 512)
    bw = measure_bandwidth(bw_mib, repeats=5 if args.quick else 11)
    print(f"bench: {machine['cpu_model']}, {machine['usable_cpus']} cpus; bandwidth "
          f"{bw['jax_sum_read_gbs']} GB/s (jnp.sum read), {bw['numpy_copy_gbs']} GB/s (numpy copy)", flush=True)
    ctx = Context(quick=args.quick, seed=args.seed, machine=machine, bandwidth=bw)

    results, failed = {}, []
    for name in args.rows:
        t0 = time.perf_counter()
        try:
            res = ROWS[name].fn(ctx)
            results[name] = {"records": res.records, "markdown": res.markdown,
                             "seconds": time.perf_counter() - t0}
        except Exception as e:  # keep the other rows; the report names the failure
            traceback.print_exc()
            failed.append(name)
            results[name] = {"records": [], "error": f"{type(e).__name__}: {e}",
                             "markdown": f"**FAILED**: `{type(e).__name__}: {e}`",
                             "seconds": time.perf_counter() - t0}
        print(f"\n## {name}  ({results[name]['seconds']:.0f} s)\n\n{results[name]['markdown']}\n", flush=True)
    machine["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    total = time.perf_counter() - t_start

    mode = "QUICK (smoke-test sizes — not the reported figures)" if args.quick else "full sizes"
    cmd = "python experiments/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# gemini_jax benchmarks\n",
          f"Mode: **{mode}**. Run {started:%Y-%m-%d %H:%M} UTC, {total:.0f} s, command `{cmd.strip()}`. "
          f"Written by `experiments/bench.py`; raw records in `bench.json`.\n",
          "## How to read this\n",
          "Every row compares variants measured **side by side in this one process**: each repeat runs "
          "every variant (order rotated), the headline is the **median of per-repeat ratios** with the "
          "min–max over repeats in parentheses, and compilation / warm-up is done before any timing. "
          "Absolute times are shown alongside for scale only; never compare them across runs.\n",
          NOTE + "\n"]
    md += [f"- **`{name}`** — {ROWS[name].about}" for name in args.rows]
    md += ["\n## Machine\n", machine_markdown(machine, bw)]
    for name in args.rows:
        md += [f"\n## {name}\n", results[name]["markdown"]]
    with open(os.path.join(args.out, "BENCH.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"mode": "quick" if args.quick else "full", "started_utc": started.isoformat(),
                   "seconds": total, "command": cmd.strip(), "commit": git_commit(), "code": code_files(),
                   "config": vars(args), "split": None,
                   "seeds": [args.seed], "machine": machine, "bandwidth": bw,
                   "rows": {n: {"about": ROWS[n].about, **results[n]} for n in args.rows}},
                  f, indent=1, default=float)
    print(f"bench: wrote {args.out}/BENCH.md and bench.json in {total:.0f} s"
          + (f"; FAILED rows: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
