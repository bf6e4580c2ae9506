"""Row `tiers_link`: decode over tiers with emulated links (`tier.link="emulate"`), device share x
prefetch depth x link, against the all-resident engine, side by side."""

from __future__ import annotations

import os

import numpy as np
from omegaconf import OmegaConf

from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.tiers import TierVariant, tier_bench_model
from gemini_jax.bench.timing import fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats
from gemini_jax.config import HardwareConfig, ModelConfig, TierConfig, from_dict
from gemini_jax.tiers.link import link_for, matched_link

GOAL_RATIO, GOAL_HIT, GOAL_STILL = 0.9, 0.95, 0.95
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PRESETS = ("h200", "l40s", "rtx4090")
N_LINKS = 1 + 2 + 2 * len(PRESETS)  # real, nominal PCIe 4 / 5, each preset matched at PCIe 4 / 5


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(contexts=[2048], shares=[1.0, 0.25], depths=[0, 2], steps=3, repeats=3, warmup=3,
                               block_size=16, sparse_budget=128, chunk=128),
                    full=dict(contexts=[16384, 32768], shares=[1.0, 0.5, 0.25, 0.1], depths=[0, 1, 2, 4], steps=6,
                              repeats=5, warmup=4, block_size=16, sparse_budget=1024, chunk=512))


def _conf(kind: str, name: str, cls):
    data = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "conf", kind, f"{name}.yaml")), resolve=True)
    data.pop("defaults", None)
    return from_dict(cls, data, where=f"conf/{kind}/{name}.yaml")


def _links(layer_seconds: float, block_size: int) -> tuple[dict, dict]:
    """name -> LinkConfig (None: real links), and what each matched link used."""
    links, used = {"real": None}, {}
    h200 = _conf("hardware", "h200", HardwareConfig)
    for pcie in (4, 5):  # the preset's nominal figures, in real time: the step's software against fast links
        links[f"nominal PCIe {pcie}"] = link_for(h200, pcie=pcie)
    for name in PRESETS:
        hw = _conf("hardware", name, HardwareConfig)
        ref = _conf("model", hw.reference_model, ModelConfig)
        for pcie in (4, 5):
            links[f"{name} PCIe {pcie}"], used[f"{name} PCIe {pcie}"] = matched_link(
                hw, ref, pcie=pcie, layer_seconds_here=layer_seconds, block_size=block_size)
    assert len(links) == N_LINKS
    return links, used


@row("tiers_link", about=(
    "Decode step (batch 1, chunk-sparse attention, block 16) of the engine over tiers — device slots for 100 / 50 "
    "/ 25 / 10 % of the pages, the rest in host RAM, prefetch depth 0 / 1 / 2 / 4 — with its transfers timed by "
    "emulated links (`tier.link=emulate`: a prefetched page counts only once the link model lands it; a step "
    "needing it earlier sleeps until then), against the all-resident engine. Links: *real* (a page is there "
    "when its copy is done); *nominal PCIe 4 / 5* (25 / 50 GB/s x16, 10 µs a transfer, in real time: fast "
    "links against this CPU's slow step, so what is left is the machinery's own cost); *<preset> PCIe 4 / 5* "
    "(matched: a page is timed as a page of the preset's reference model, and every time is scaled by one "
    "layer of the step here over one layer of that model's weights-bound decode step on the preset, so a "
    "transfer costs beside a layer what it would there). Each engine is prefilled once and timed under every "
    "link (`TieredStore.set_link`); each repeat runs every (engine, link) for a few greedy steps, interleaved "
    "with the all-resident engine, order rotated; speed = median over repeats of all-resident / tiered step "
    "time; hit rate = prefetched pages that had landed when their layer needed them / pages needed from below. "
    "Goals: 25 % device, depth 2, PCIe 5: ≥ 0.9× and ≥ 95 % hit rate; real links with no page moving "
    "(100 %, depth 0): ≥ 0.95×."))
def tiers_link(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    model, text_of, model_desc = tier_bench_model()
    records, notes = [], {}
    for context in s["contexts"]:
        toks = text_of(context, np.random.default_rng(ctx.seed))
        for share in s["shares"]:
            live = {"all-resident": TierVariant(model, toks, {**s, "repeats": s["repeats"] + 1}, tier=None)}
            # Every tiered engine runs (1 + steps) steps per link per repeat.
            grown = {**s, "steps": s["steps"] + 1, "repeats": s["repeats"] * N_LINKS}
            for d in s["depths"]:
                live[f"depth {d}"] = TierVariant(model, toks, grown, tier=TierConfig(
                    enabled=True, device_fraction=share, prefetch_depth=d, hot_threshold=0, link="emulate"))
            try:
                for v in live.values():
                    for _ in range(s["warmup"]):
                        v.step()
                ref = live["all-resident"]
                layer_s = ref.timed(s["steps"]) / model.cfg.num_layers
                links, used = _links(layer_s, s["block_size"])
                notes[context] = {"layer_seconds_here": layer_s, "links": used}
                cells = {(d, ln): (v, link) for d, v in live.items() if d != "all-resident" for ln, link in links.items()}

                def timed(cell):
                    v, link = cell
                    v.eng.set_link(link)
                    v.step()  # one step to fill the staging buffer under this link, untimed
                    before = dict(v.stats)
                    t = v.timed(s["steps"])
                    counts[id(cell)].append({k: v.stats[k] - before[k] for k in ("prefetch_hits", "prefetch_misses",
                                                                                   "stall_seconds")})
                    return t

                counts = {id(c): [] for c in cells.values()}
                fns = {"all-resident": lambda: ref.timed(s["steps"])}
                fns.update({f"{d} | {ln}": (lambda c=c: timed(c)) for (d, ln), c in cells.items()})
                times = interleaved(fns, s["repeats"], desc=f"tiers_link @ {context}, {share:.0%}")
                for (d, ln), c in cells.items():
                    hits = sum(x["prefetch_hits"] for x in counts[id(c)])
                    misses = sum(x["prefetch_misses"] for x in counts[id(c)])
                    name = f"{d} | {ln}"
                    rec = {"row": "tiers_link", "model": model_desc, "context": context, "device_fraction": share,
                           "prefetch_depth": int(d.split()[1]), "link": ln,
                           "link_model": None if c[1] is None else c[1].__dict__,
                           "step_seconds_median": median(times[name]), "step_seconds_all": times[name],
                           "all_resident_step_seconds_all": times["all-resident"],
                           "prefetch_hits": hits, "prefetch_misses": misses,
                           "hit_rate": hits / (hits + misses) if hits + misses else None,
                           "stall_seconds_per_step": sum(x["stall_seconds"] for x in counts[id(c)])
                           / (s["steps"] * s["repeats"]),
                           "tokens_equal_all_resident": c[0].tokens[:len(ref.tokens)] == ref.tokens[:len(c[0].tokens)],
                           **{"speed_vs_all_resident_" + k: x
                              for k, x in ratio_stats(times["all-resident"], times[name]).items()}}
                    records.append(rec)
            finally:
                for v in live.values():
                    v.close()
    records.append({"row": "tiers_link", "metric": "setup", "sizes": s, "model": model_desc, "links_used": notes})
    return RowResult(records=records, markdown=_markdown(records, s, model_desc, notes))


def _goal(r) -> str:
    ok = []
    if r["device_fraction"] == 0.25 and r["prefetch_depth"] == 2 and r["link"].endswith("PCIe 5"):
        ok.append("✓" if r["speed_vs_all_resident_ratio"] >= GOAL_RATIO else "✗")
        ok.append("✓" if (r["hit_rate"] or 0) >= GOAL_HIT else "✗")
    if r["device_fraction"] == 1.0 and r["prefetch_depth"] == 0 and r["link"] == "real":
        ok.append("✓" if r["speed_vs_all_resident_ratio"] >= GOAL_STILL else "✗")
    return " ".join(ok)


def _markdown(records, s, model_desc, notes) -> str:
    rows = []
    for r in records:
        if r.get("metric"):
            continue
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        rows.append([r["context"], f"{r['device_fraction']:.0%}", r["prefetch_depth"], r["link"],
                     fmt_ms(r["step_seconds_median"]), fmt_ratio(r, "speed_vs_all_resident_"), hit,
                     fmt_ms(r["stall_seconds_per_step"]), "✓" if r["tokens_equal_all_resident"] else "✗", _goal(r)])
    md = md_table(["context", "device", "depth", "link", "step", "speed vs all-resident", "hit rate",
                   "stall / step", "same tokens", "goal"], rows)
    scales = "; ".join(f"{ctx}: " + ", ".join(f"{k} ×{v['time_scale']:.1f}" for k, v in n["links"].items())
                       for ctx, n in notes.items())
    md += (f"\n\n**Setup.** {model_desc}; block {s['block_size']}, sparse budget {s['sparse_budget']} tokens, "
           f"host tier unbounded (no disk), hot zone off. {s['steps']} greedy steps per cell per repeat, "
           f"{s['repeats']} repeats, min–max of the per-repeat ratios in parentheses. Matched links' time scales "
           f"({scales}). Goals (✓/✗ in the last column): 25 % device, depth 2, PCIe 5: speed ≥ {GOAL_RATIO}× and "
           f"hit rate ≥ {GOAL_HIT:.0%}; real links, 100 %, depth 0: ≥ {GOAL_STILL}×.")
    return md
