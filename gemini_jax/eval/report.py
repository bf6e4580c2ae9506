"""Write evaluation results as JSON + markdown + a PNG heatmap (depth x length)."""

from __future__ import annotations

import json
import os

from gemini_jax.eval.needle import NeedleResult


def needle_markdown(res: NeedleResult, title: str) -> str:
    head = "| length \\ depth | " + " | ".join(f"{d:.2f}" for d in res.depths) + " | mean |"
    sep = "|" + "---|" * (len(res.depths) + 2)
    rows = [f"| {L} | " + " | ".join(f"{a:.2f}" for a in accs) + f" | {sum(accs) / len(accs):.2f} |"
            for L, accs in zip(res.lengths, res.accuracy)]
    totals = ["", "| length | right / trials | accuracy [95% Wilson interval] |", "|---|---|---|"]
    totals += [f"| {r['length']} | {r['hits']} / {r['trials']} | {100 * r['accuracy']:.1f}% "
               f"[{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}] |" for r in res.by_length()]
    return "\n".join([f"### {title}", "", f"{res.trials} trials per cell; exact match of the 5-digit key.",
                      "", head, sep, *rows, *totals, ""])


def needle_heatmap(res: NeedleResult, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    acc = np.asarray(res.accuracy).T  # depth rows, length columns
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(res.lengths), 1.2 + 0.5 * len(res.depths)))
    im = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(res.lengths)), [f"{L // 1024}K" if L >= 1024 else str(L) for L in res.lengths])
    ax.set_yticks(range(len(res.depths)), [f"{d:.2f}" for d in res.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    for (r, c), v in np.ndenumerate(acc):
        ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_needle(res: NeedleResult, out_dir: str, name: str, title: str, extra: dict | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{name}.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as fh:
        json.dump({**res.to_dict(), **(extra or {})}, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(needle_markdown(res, title))
    needle_heatmap(res, paths["png"], title)
    return paths
