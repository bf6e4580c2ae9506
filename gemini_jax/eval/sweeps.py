"""An ablation sweep read back: the JSON files `experiments/ablate.py` writes, one per point of a
Hydra multirun, as a markdown table with the caveats a reader must see, and one PNG per metric.
`python experiments/results.py --report <sweep dir or name>` writes them beside the JSON files."""

from __future__ import annotations

import glob
import json
import math
import os

from gemini_jax.errors import ConfigError

# (metric key, column / axis label, format) in report order.
METRICS = [
    ("decode_tokens_per_s", "decode tokens/s", "{:.1f}"),
    ("kv_bytes_read_per_token", "KV bytes read / token", "{:,.0f}"),
    ("needle_accuracy", "needle accuracy", "{:.2f}"),
    ("bits_per_byte", "bits / byte", "{:.3f}"),
]
EXTRA_COLUMNS = [
    ("prefill_tokens_per_s", "prefill tokens/s", "{:.0f}"),
    ("kv_read_overhead", "KV read / valid", "{:.2f}"),
    ("digest_bytes_read_per_token", "digest bytes / token", "{:,.0f}"),
    ("prefetch_hit_rate", "prefetch hit rate", "{:.2f}"),
    ("pages_fetched_per_token", "pages fetched / token", "{:.1f}"),
    ("stall_ms_per_token", "stall ms / token", "{:.2f}"),
]


def find_sweep(target: str, results_dir: str) -> str:
    """A sweep directory from a directory path or a sweep name (its latest sweep)."""
    if os.path.isdir(target):
        return os.path.abspath(target)
    base = os.path.join(results_dir, "ablations", target)
    subdirs = [d for d in glob.glob(os.path.join(base, "*")) if os.path.isdir(d) and glob.glob(os.path.join(d, "*.json"))]
    if not subdirs:
        raise ConfigError(f"{target!r} is neither a directory nor a sweep name with results under {base}/; run "
                          f"`python experiments/ablate.py --multirun experiment={target}` first.")
    return max(subdirs, key=lambda d: max(os.path.getmtime(f) for f in glob.glob(os.path.join(d, "*.json"))))


def load_sweep(sweep_dir: str) -> list[dict]:
    """The sweep's job records, sorted by the swept value. JSON files that are not job records are
    skipped; a file that is not JSON at all stops the report (a job cut short must not vanish from
    the table unnoticed)."""
    records = []
    for path in sorted(glob.glob(os.path.join(sweep_dir, "*.json"))):
        with open(path) as fh:
            try:
                rec = json.load(fh)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path} is not valid JSON ({err}); the job that wrote it was probably cut short. "
                                  f"Rerun that sweep point, or remove the file to report without it.")
        if isinstance(rec, dict) and "sweep" in rec and "metrics" in rec:
            rec["_path"] = path
            records.append(rec)
    if not records:
        raise ConfigError(f"no ablation JSON files in {sweep_dir}.")
    knobs = sorted({r["sweep"]["knob"] for r in records})
    if len(knobs) > 1:
        raise ConfigError(f"{sweep_dir} mixes sweeps over {knobs}; give one sweep's directory.")
    return sorted(records, key=lambda r: _sort_key(r["sweep"]["value"]))


def _sort_key(v):
    return (0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))


def _fmt(fmt: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return fmt.format(v)


def notes(records: list[dict]) -> list[str]:
    """Caveats the reader must see before the numbers."""
    out = []
    first = records[0]
    if any(r["prefetch"]["depth"] is not None and not r["prefetch"]["applied"] for r in records):
        out.append("**Prefetch NOT applied**: `prefetch_depth` was recorded but the engine ran without "
                   "tiers (every KV page device-resident, nothing fetched), so differences between "
                   "rows are run-to-run noise, not an effect of the knob.")
    if any(not r["model"]["trained"] for r in records):
        out.append(f"**Model: {first['model']['description']}** — needle accuracy and bits/byte of a "
                   f"random model carry no signal; only speed and bytes moved are meaningful.")
    else:
        out.append(f"Model: {first['model']['description']}.")
    models = {r["model"]["description"] for r in records}
    if len(models) > 1:
        out.append(f"Jobs used different models: {sorted(models)}.")
    w = first["workload"]
    out.append(f"Workload per job: decode {w['decode_tokens']} tokens after a {w['prompt_tokens']}-token "
               f"held-out prompt (median of {w['decode_repeats']} runs after a compiling warm-up); needle "
               f"at {w['needle_length']} tokens, depth {w['needle_depth']}, {w['needle_trials']} trials; "
               f"bits/byte over {w['bpb_windows']} × {w['bpb_scored']} bytes at context {w['bpb_context']}.")
    out.append("Jobs of a sweep run one after another, so tokens/s compares rows measured at different "
               "times; on a shared machine treat small differences as noise. `KV read / valid` is the "
               "bytes attention read over the bytes of the valid context (page and table padding).")
    return out


def _shown(path: str) -> str:
    """A path as it reads in a written report: relative to the working directory when inside it."""
    root, path = os.getcwd(), os.path.abspath(path)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def markdown(records: list[dict], sweep_dir: str, pngs: dict) -> str:
    sw = records[0]["sweep"]
    cols = METRICS + EXTRA_COLUMNS
    head = f"| {sw['knob']} | " + " | ".join(label for _, label, _ in cols) + " | job s |"
    sep = "|" + "---|" * (len(cols) + 2)
    rows = [f"| {r['sweep']['value']} | " + " | ".join(_fmt(f, r["metrics"].get(k)) for k, _, f in cols)
            + f" | {_fmt('{:.0f}', r.get('seconds', {}).get('job'))} |" for r in records]
    lines = [f"# Ablation `{sw['name']}` — sweep `{sw['id']}`", "",
             f"{len(records)} job(s) over `{sw['knob']}`; hardware `{records[0].get('hardware')}`, jax "
             f"{records[0].get('versions', {}).get('jax')} ({records[0].get('versions', {}).get('backend')}). "
             f"Source: `{_shown(sweep_dir)}`.", ""]
    lines += [f"- {n}" for n in notes(records)]
    lines += ["", head, sep, *rows, ""]
    lines += [f"![{label}]({os.path.basename(pngs[k])})" for k, label, _ in METRICS if k in pngs]
    if "summary" in pngs:
        lines += ["", f"![summary]({os.path.basename(pngs['summary'])})"]
    return "\n".join(lines) + "\n"


def plots(records: list[dict], out_dir: str) -> dict:
    """One PNG per metric and a 2x2 summary; returns {metric: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = records[0]["sweep"]
    values = [r["sweep"]["value"] for r in records]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    xs = values if numeric else list(range(len(values)))
    log2 = numeric and min(values) > 0 and max(values) / min(values) >= 8
    caveat = ""
    if any(r["prefetch"]["depth"] is not None and not r["prefetch"]["applied"] for r in records):
        caveat = "prefetch NOT applied: no tiers"
    elif any(not r["model"]["trained"] for r in records):
        caveat = "random-init model"

    def draw(ax, key, label):
        ys = [r["metrics"].get(key) for r in records]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        if key == "decode_tokens_per_s":  # each repeat, to show the spread behind the median
            for x, r in zip(xs, records):
                runs = r.get("decode_tokens_per_s_runs") or []
                ax.plot([x] * len(runs), runs, ".", color="gray", alpha=0.6)
        if key == "needle_accuracy":
            ax.set_ylim(-0.05, 1.05)
        elif key in ("decode_tokens_per_s", "kv_bytes_read_per_token") and pts:
            ax.set_ylim(bottom=0)
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(v) for v in values])
        ax.set_xlabel(sw["knob"])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)

    paths = {}
    for key, label, _ in METRICS:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        draw(ax, key, label)
        ax.set_title(f"{sw['name']}: {label}" + (f"\n({caveat})" if caveat else ""), fontsize=9)
        fig.tight_layout()
        paths[key] = os.path.join(out_dir, f"{key}.png")
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (key, label, _) in zip(axes.flat, METRICS):
        draw(ax, key, label)
    fig.suptitle(f"{sw['name']} ({sw['id']})" + (f" — {caveat}" if caveat else ""), fontsize=10)
    fig.tight_layout()
    paths["summary"] = os.path.join(out_dir, "summary.png")
    fig.savefig(paths["summary"], dpi=110)
    plt.close(fig)
    return paths


def write_report(sweep_dir: str) -> dict:
    """Read a sweep directory's JSONs, write REPORT.md + PNGs beside them; returns their paths."""
    records = load_sweep(sweep_dir)
    pngs = plots(records, sweep_dir)
    md_path = os.path.join(sweep_dir, "REPORT.md")
    with open(md_path, "w") as fh:
        fh.write(markdown(records, sweep_dir, pngs))
    return {"md": md_path, **pngs}
