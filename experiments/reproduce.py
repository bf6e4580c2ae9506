"""Rerun a sample of a committed record's trials at this commit and say whether they reproduce.

    python experiments/reproduce.py needle/rerank_8k_test --sample 10    # 10 trials spread over the grid
    python experiments/reproduce.py perplexity/bpb_extrapolate_test --sample 2   # 2 windows per context

`make results SUBSET=reproduce` runs it over every needle and bits-per-byte record docs/results.md
shows. The needle and bits-per-byte subsets take hours of CPU to rerun whole; a sample of each
record's trials, rerun through the engine configuration the record names, tells in minutes whether
the figures still hold at the current commit (`gemini_jax.eval.reproduce`). Each run writes
`experiments/results/reproduce/<study>_<name>.json` (+ .md) with this commit, the sample, and each
trial then and now; the `results:reproduce` block of docs/results.md is rendered from those files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gemini_jax.eval.record import StudyResult, make_record, write_record
from gemini_jax.eval.reproduce import rerun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")


def markdown(rec: dict) -> str:
    r = rec["outcome"]
    head = (f"### Reproduction of [{rec['source']}](../{rec['source']}.md) at `{rec['commit'][:7]}`\n\n"
            f"Recorded at `{rec['source_commit'][:7]}`; {r['checked']} trials rerun one by one through the engine "
            f"configuration the record names: **{r['equal']}/{r['checked']} reproduce**"
            + (f" (max |Δ bits/byte| {r['max_abs_diff']:.2e}, tolerance {r['tolerance']:.0e})" if r["kind"] == "bpb"
               else " (the same generated text)") + ".\n\n")
    if r["kind"] == "needle":
        rows = ["| trial | length | depth | key | recorded | now | same |", "|---|---|---|---|---|---|---|"]
        rows += [f"| {x['trial']} | {x['length']} | {x['depth']} | {x['key']} | `{x['recorded']!r}` | `{x['now']!r}` | "
                 f"{'✓' if x['equal'] else '✗'} |" for x in rec["records"]]
    else:
        rows = ["| context | window | recorded | now | abs diff | same |", "|---|---|---|---|---|---|"]
        rows += [f"| {x['context']} | {x['window']} | {x['recorded']:.6f} | {x['now']:.6f} | {x['abs_diff']:.1e} | "
                 f"{'✓' if x['equal'] else '✗'} |" for x in rec["records"]]
    return head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="<study>/<name> of a needle or perplexity record under experiments/results/")
    ap.add_argument("--sample", type=int, default=10,
                    help="needle: trials to rerun, spread over the grid; perplexity: windows per context")
    args = ap.parse_args(argv)
    path = os.path.join(RESULTS, args.record + ".json")
    if not os.path.exists(path):
        ap.error(f"no record {path}")
    with open(path) as fh:
        source = json.load(fh)
    outcome = rerun(source, args.sample)
    print(f"{args.record}: {outcome['equal']}/{outcome['checked']} trials reproduce"
          + (f", max |Δ| {outcome['max_abs_diff']:.2e}" if outcome["kind"] == "bpb" else ""))
    for row in outcome["rows"]:
        if not row["equal"]:
            print(f"  differs: {row}")
    study, name = args.record.split("/", 1)
    rec = make_record("reproduce", StudyResult(
        name=f"{study}_{name}", records=outcome["rows"], split=source["split"], seeds=source["seeds"],
        extra={"source": args.record, "source_commit": source["commit"],
               "outcome": {k: v for k, v in outcome.items() if k != "rows"}}),
        command="python experiments/reproduce.py " + " ".join(sys.argv[1:] if argv is None else argv),
        config={"record": args.record, "sample": args.sample})
    paths = write_record(RESULTS, rec, markdown(rec))
    print(f"written {os.path.relpath(paths['json'], ROOT)}")
    return 0 if outcome["equal"] == outcome["checked"] else 1


if __name__ == "__main__":
    sys.exit(main())
