"""Ablation jobs: one small, fixed workload per point of a Hydra sweep.

    python experiments/ablate.py --multirun experiment=ablate_block_size       # 8 .. 256
    python experiments/ablate.py --multirun experiment=ablate_prefetch_depth   # 0 .. 8 (see NOTE)
    python experiments/ablate.py --multirun experiment=ablate_block_size engine.cache.block_size=16,64 \
        sparse=quest experiment.workload.needle_length=1536
    python experiments/results.py --report ablate_block_size                   # table + plots

The sweep itself is declared in the experiment config (`hydra.sweeper.params`); a command-line
sweep of the same key replaces it. Each job builds the engine from the composed config, then on
held-out standard-library text: times greedy decoding (median of repeats, after a warm-up that
compiles the same shapes), runs a pass-key needle at one length, and measures bits per byte
through `Engine.score`. It logs config, counters and metrics to wandb (offline unless WANDB_MODE
or `wandb.mode` says otherwise; WANDB_MODE wins) and writes one JSON, keyed by the swept value,
into the sweep directory and, when `results_dir=` is set, into
`<results_dir>/ablations/<experiment.name>/<sweep id>/`.

NOTE prefetch: `experiment.prefetch_depth` is applied as `engine.tier.prefetch_depth`, and counts
as applied only with the tier enabled (ablate_prefetch_depth enables it). With the tier off every
page is device-resident and nothing is fetched: the JSON then says `"prefetch": {"applied": false}`
with the reason, the log warns, the wandb run is tagged `prefetch-not-applied`, and the report
says so above its table. Nothing is simulated.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import statistics
import sys
import time

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.config import EngineConfig, SamplingParams
from gemini_jax.data import corpus, tasks
from gemini_jax.eval.record import provenance
from gemini_jax.eval.trials import Draw
from gemini_jax.hydra_schema import build, one_line_errors, register
from run import load_model  # the main job's model loading and labelling (this script's directory is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))

register()
ROOT = os.path.dirname(HERE)
log = logging.getLogger("ablate")

PREFETCH_NOTE = ("prefetch_depth={depth} is recorded but NOT APPLIED: this engine config has no "
                 "tier section (every page stays device-resident), "
                 "so no metric of this job depends on it.")


# ---- config ---------------------------------------------------------------------------------
def _workload(cfg: DictConfig) -> dict:
    ex = cfg.experiment
    if "workload" not in ex or "knob" not in ex:
        raise gj.errors.ConfigError(
            f"experiment={ex.get('name')!r} is not an ablation (it has no `knob` / `workload`); "
            f"select one with experiment=ablate_block_size or experiment=ablate_prefetch_depth "
            f"(conf/experiment/ablate_*.yaml).")
    w = {k: (float(v) if k == "needle_depth" else int(v)) for k, v in ex.workload.items()}
    for k, v in w.items():
        if k != "needle_depth" and v < 1:
            raise gj.errors.ConfigError(f"experiment.workload.{k}={v} must be >= 1.")
    if not 0.0 <= w["needle_depth"] <= 1.0:
        raise gj.errors.ConfigError(f"experiment.workload.needle_depth={w['needle_depth']} must be in [0, 1].")
    if w["bpb_scored"] >= w["bpb_context"]:
        raise gj.errors.ConfigError(f"experiment.workload.bpb_scored={w['bpb_scored']} must be < "
                                    f"bpb_context={w['bpb_context']}.")
    return w


def _engine_config(cfg: DictConfig, w: dict) -> tuple[EngineConfig, dict]:
    """The engine config of this job (max_seq_len raised to fit the workload), and what prefetch does."""
    data = OmegaConf.to_container(cfg.engine, resolve=True)
    longest = max(w["prompt_tokens"] + w["decode_tokens"], w["needle_length"] + 16, w["bpb_context"] + 1)
    if data["max_seq_len"] < longest:
        log.info("engine.max_seq_len raised from %d to %d to fit the workload", data["max_seq_len"], longest)
        data["max_seq_len"] = longest
    depth = cfg.experiment.get("prefetch_depth")
    prefetch = {"depth": None if depth is None else int(depth), "applied": False, "note": ""}
    tier = data.get("tier")
    if depth is not None and isinstance(tier, dict) and "prefetch_depth" in tier:
        tier["prefetch_depth"] = int(depth)  # the engine has a tiered cache: the knob is real ...
        if tier.get("enabled", True):
            prefetch.update(applied=True, note=f"applied as engine.tier.prefetch_depth={int(depth)}")
        else:  # ... but with the tier off every page is device-resident and nothing is fetched
            prefetch["note"] = (f"prefetch_depth={int(depth)} set but NOT APPLIED: engine.tier.enabled is "
                                f"false (all pages device-resident); select a tiered config, e.g. tier=host.")
    elif depth is not None:
        prefetch["note"] = PREFETCH_NOTE.format(depth=int(depth))
    return build(EngineConfig, data), prefetch


def _rel(path):
    """Paths inside the repository are recorded relative to it (results are committed)."""
    if path is None:
        return None
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def _sweep_info(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    knob = str(cfg.experiment.knob)
    absent = object()
    value = OmegaConf.select(cfg, knob, default=absent, throw_on_missing=True)
    if value is absent:
        raise gj.errors.ConfigError(f"experiment.knob={knob!r} is not a key of the composed config.")
    multirun = hc.mode == RunMode.MULTIRUN
    sweep_dir = hc.sweep.dir if multirun else hc.runtime.output_dir
    sweep_dir = os.path.abspath(sweep_dir)
    return {"name": str(cfg.experiment.name), "knob": knob, "value": value,
            "key": f"{knob.rsplit('.', 1)[-1]}={value}", "id": os.path.basename(sweep_dir.rstrip(os.sep)),
            "dir": _rel(sweep_dir), "multirun": multirun, "job_num": hc.job.num if multirun else 0,
            "job_dir": _rel(hc.runtime.output_dir), "overrides": list(hc.overrides.task)}


# ---- workload -------------------------------------------------------------------------------
def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _kv_bytes_valid(mcfg, itemsize: int, prompt_len: int, steps: int) -> int:
    """KV bytes a perfect reader would touch over `steps` decode steps (no page padding)."""
    per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * itemsize
    lengths = prompt_len + 1 + np.arange(steps)  # tokens in the cache at each step's attention
    return int(per_token * lengths.sum())


def decode_timing(eng: gj.Engine, tok, text: np.ndarray, w: dict, seed: int) -> dict:
    """Greedy decode of `decode_tokens` after a held-out prompt: one warm-up, then timed repeats.

    Each run uses a fresh text window (so no prefix is reused and every run computes the same
    shapes the warm-up compiled); EOS is ignored so every run decodes the same number of steps.
    """
    rng = np.random.default_rng([seed, 1])
    params = SamplingParams(max_new_tokens=w["decode_tokens"], temperature=0.0, stop_at_eos=False)

    def prompt():
        if isinstance(tok, gj.ByteTokenizer):
            return [tok.BOS, *map(int, tasks.text_window(text, w["prompt_tokens"] - 1, rng))]
        body = bytes(tasks.text_window(text, w["prompt_tokens"] * 8, rng)).decode("utf-8", "replace")
        return tok.encode(body, bos=True)[: w["prompt_tokens"]]

    t0 = time.perf_counter()
    eng.generate(prompt(), params)  # compile
    warmup_s = time.perf_counter() - t0
    before = dict(eng.stats)
    runs = []
    for _ in range(w["decode_repeats"]):
        ids = prompt()
        out = eng.generate(ids, params)
        runs.append({"prompt_tokens": len(ids), "generated": len(out.tokens),
                     "prefill_s": out.seconds["prefill"], "decode_s": out.seconds["decode"],
                     "decode_steps": out.stats["decode_steps"]})
    stats = _delta(before, eng.stats)
    steps = stats["decode_steps"]
    mcfg = eng.model_cfg
    valid = sum(_kv_bytes_valid(mcfg, eng.cache_dtype.itemsize, r["prompt_tokens"], r["decode_steps"]) for r in runs)
    tps = [r["decode_steps"] / max(r["decode_s"], 1e-9) for r in runs]
    pps = [r["prompt_tokens"] / max(r["prefill_s"], 1e-9) for r in runs]
    return {"runs": runs, "warmup_s": warmup_s, "stats": stats,
            "decode_tokens_per_s": statistics.median(tps), "decode_tokens_per_s_runs": tps,
            "prefill_tokens_per_s": statistics.median(pps),
            "kv_bytes_read_per_token": stats["kv_bytes_read"] / max(steps, 1),
            "kv_bytes_valid_per_token": valid / max(steps, 1),
            "kv_read_overhead": stats["kv_bytes_read"] / max(valid, 1),
            "digest_bytes_read_per_token": stats["digest_bytes_read"] / max(steps, 1),
            "pages_selected_per_token": stats["pages_selected"] / max(steps, 1),
            "prefetch_hit_rate": (stats["prefetch_hits"] / (stats["prefetch_hits"] + stats["prefetch_misses"])
                                  if stats["prefetch_hits"] + stats["prefetch_misses"] else None),
            "pages_fetched_per_token": (stats["pages_fetched_host"] + stats["pages_fetched_disk"]) / max(steps, 1),
            "stall_ms_per_token": 1e3 * stats["stall_seconds"] / max(steps, 1)}


def run_workload(eng: gj.Engine, tok, w: dict, seed: int, byte_level: bool) -> dict:
    from gemini_jax.eval import needle, perplexity

    _, text = corpus.load_split("heldout")
    res, secs = {}, {}
    t0 = time.perf_counter()
    res["decode"] = decode_timing(eng, tok, text, w, seed)
    secs["decode"] = time.perf_counter() - t0
    if byte_level:  # gemini_jax.eval's tasks are byte-level (ByteTokenizer ids)
        before = dict(eng.stats)
        t0 = time.perf_counter()
        nd = needle(eng, [w["needle_length"]], [w["needle_depth"]], trials=w["needle_trials"],
                    batch=min(w["needle_trials"], eng.config.max_batch), haystack=text, draw=Draw("dev", seed))  # ablations choose knobs
        secs["needle"] = time.perf_counter() - t0
        res["needle"] = {"accuracy": nd.overall, "length": w["needle_length"], "depth": w["needle_depth"],
                         "trials": nd.trials, "records": nd.records, "stats": _delta(before, eng.stats)}
        before = dict(eng.stats)
        t0 = time.perf_counter()
        pp = perplexity(eng, w["bpb_context"], windows=w["bpb_windows"], scored=w["bpb_scored"],
                        text=text, draw=Draw("dev", seed))
        secs["bits_per_byte"] = time.perf_counter() - t0
        res["bits_per_byte"] = {**pp, "stats": _delta(before, eng.stats)}
    else:
        reason = "skipped: needle and bits/byte tasks are byte-level; this model has its own tokenizer"
        res["needle"] = {"accuracy": None, "note": reason}
        res["bits_per_byte"] = {"bits_per_byte": None, "note": reason}
    res["seconds"] = secs
    return res


# ---- outputs --------------------------------------------------------------------------------
def _wandb_mode(cfg: DictConfig) -> str:
    return os.environ.get("WANDB_MODE") or str(cfg.wandb.mode)


def log_wandb(cfg: DictConfig, record: dict) -> dict:
    mode = _wandb_mode(cfg)
    os.environ["WANDB_MODE"] = mode
    import wandb

    wandb_dir = os.path.join(ROOT, cfg.wandb.dir)  # an absolute cfg.wandb.dir stays as it is
    os.makedirs(wandb_dir, exist_ok=True)
    sw, pf = record["sweep"], record["prefetch"]
    tags = ["ablation", sw["name"]] + (["prefetch-not-applied"] if pf["depth"] is not None and not pf["applied"] else [])
    tags += ["random-init-model"] if not record["model"]["trained"] else []
    run = wandb.init(project=cfg.wandb.project, dir=wandb_dir, mode=mode, job_type="ablation",
                     group=f"{sw['name']}/{sw['id']}", name=f"{sw['name']}:{sw['key']}", tags=tags,
                     notes=" ".join(x for x in (record["model"]["description"], pf["note"]) if x),
                     config={**OmegaConf.to_container(cfg, resolve=True), "sweep": sw, "prefetch": pf,
                             "model_description": record["model"]["description"]})
    flat = {k: v for k, v in record["metrics"].items() if isinstance(v, (int, float)) and v is not None}
    for phase in ("decode", "needle", "bits_per_byte"):
        flat.update({f"stats/{phase}/{k}": v for k, v in record["stats"].get(phase, {}).items()})
    flat.update({f"stats/total/{k}": v for k, v in record["stats"]["total"].items()})
    flat[sw["knob"]] = sw["value"]
    run.log(flat)
    run.summary.update({"prefetch_applied": pf["applied"], "model_trained": record["model"]["trained"]})
    info = {"mode": mode, "dir": _rel(wandb_dir), "run_id": run.id,
            "run_dir": _rel(getattr(run, "dir", None))}
    run.finish()
    return info


def write_json(record: dict, cfg: DictConfig) -> list[str]:
    sw = record["sweep"]
    out_dirs = [os.path.join(ROOT, sw["dir"])]
    if cfg.get("results_dir"):  # unset: the sweep directory alone (git-ignored); make results sets it
        out_dirs.append(os.path.join(ROOT, cfg.results_dir, "ablations", sw["name"], sw["id"]))
    paths = []
    for d in out_dirs:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"{sw['key']}.json")
        if os.path.exists(path) and sw["multirun"]:  # same value twice (another key swept too)
            path = os.path.join(d, f"{sw['key']}_job{sw['job_num']}.json")
        with open(path, "w") as fh:
            json.dump(record, fh, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
        paths.append(path)
    return paths


# ---- job ------------------------------------------------------------------------------------
@hydra.main(version_base=None, config_path="../conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc)
    t_job = time.perf_counter()
    w = _workload(cfg)
    sweep = _sweep_info(cfg)
    ecfg, prefetch = _engine_config(cfg, w)
    log.info("ablation %s, job %d: %s", sweep["name"], sweep["job_num"], sweep["key"])
    if prefetch["depth"] is not None and not prefetch["applied"]:
        log.warning("NOTE: %s", prefetch["note"])
    model, tok, desc = load_model(cfg)
    # load_model's order: HF weights, else the shipped tiny model, else a random init.
    trained = bool(cfg.weights) or (model.cfg.family == "tiny" and tiny.available())
    log.info("model: %s", desc)
    eng = gj.Engine(model, ecfg)
    res = run_workload(eng, tok, w, int(cfg.seed), isinstance(tok, gj.ByteTokenizer))
    d = res["decode"]
    metrics = {
        "decode_tokens_per_s": d["decode_tokens_per_s"], "prefill_tokens_per_s": d["prefill_tokens_per_s"],
        "kv_bytes_read_per_token": d["kv_bytes_read_per_token"],
        "kv_bytes_valid_per_token": d["kv_bytes_valid_per_token"], "kv_read_overhead": d["kv_read_overhead"],
        "digest_bytes_read_per_token": d["digest_bytes_read_per_token"],
        "pages_selected_per_token": d["pages_selected_per_token"],
        "prefetch_hit_rate": d["prefetch_hit_rate"], "pages_fetched_per_token": d["pages_fetched_per_token"],
        "stall_ms_per_token": d["stall_ms_per_token"],
        "needle_accuracy": res["needle"]["accuracy"], "bits_per_byte": res["bits_per_byte"]["bits_per_byte"],
    }
    overrides = list(HydraConfig.get().overrides.task)
    record = {
        # ablations choose knobs: their trials are dev trials (gemini_jax.eval.trials)
        **provenance(command=" ".join(["python experiments/ablate.py", *overrides]),
                     config=OmegaConf.to_container(cfg.experiment, resolve=True), split="dev", seeds=[int(cfg.seed)]),
        "sweep": sweep, "prefetch": prefetch,
        "model": {"description": desc, "trained": trained, "family": model.cfg.family,
                  "num_params": model.cfg.num_params()},
        "hardware": str(cfg.hardware.name), "engine": OmegaConf.to_container(cfg.engine, resolve=True),
        "engine_effective": {"max_seq_len": ecfg.max_seq_len, "num_pages": ecfg.num_pages,
                             "pages_per_seq": ecfg.pages_per_seq, "block_size": ecfg.cache.block_size,
                             "cache_kind": ecfg.cache.kind, "sparse": ecfg.sparse.enabled,
                             "attention_impl": ecfg.attention_impl, "tier": ecfg.tier.enabled,
                             "prefetch_depth": ecfg.tier.prefetch_depth,
                             "device_slots_per_layer": (ecfg.tier.device_slots(ecfg.num_pages)
                                                        if ecfg.tier.enabled else None)},
        "workload": w, "metrics": metrics,
        "stats": {"decode": d["stats"], "needle": res["needle"].get("stats", {}),
                  "bits_per_byte": res["bits_per_byte"].get("stats", {}), "total": dict(eng.stats)},
        "decode_runs": d["runs"], "decode_tokens_per_s_runs": d["decode_tokens_per_s_runs"],
        "needle_records": res["needle"].get("records", []),
        "seconds": {**res["seconds"], "decode_warmup_incl_compile": d["warmup_s"]},
        "versions": {"jax": __import__("jax").__version__, "backend": __import__("jax").default_backend(),
                     "python": sys.version.split()[0]},
        "started_utc": started.isoformat(),
    }
    record["wandb"] = log_wandb(cfg, record)
    record["seconds"]["job"] = time.perf_counter() - t_job
    paths = write_json(record, cfg)
    na = metrics["needle_accuracy"]
    log.info("%s: decode %.1f tok/s, KV read %.0f B/token (x%.2f of valid), needle %s, bits/byte %s%s",
             sweep["key"], metrics["decode_tokens_per_s"], metrics["kv_bytes_read_per_token"],
             metrics["kv_read_overhead"], "-" if na is None else f"{na:.2f}",
             "-" if metrics["bits_per_byte"] is None else f"{metrics['bits_per_byte']:.3f}",
             "" if trained else "  [RANDOM-INIT model: accuracy and bits/byte are meaningless]")
    if prefetch["depth"] is not None and not prefetch["applied"]:
        log.warning("NOTE: prefetch not applied (no tiers); prefetch_depth=%d had no effect on these numbers",
                    prefetch["depth"])
    log.info("wrote %s", " and ".join(paths))
    return metrics


if __name__ == "__main__":
    main()
