"""Export the newest training checkpoint as the shipped model and measure its model card.

    python experiments/export_tiny.py                 # -> gemini_jax/assets/tiny/
    python experiments/export_tiny.py +trials=200 +bpb_windows=16

Writes model.safetensors + config.json (native names) and card.json: training config and step,
corpus manifest (content hashes), needle accuracy at the training lengths through the paged
engine, held-out bits per byte vs a unigram baseline, and the weights' sha256.
"""

from __future__ import annotations

import json
import os
import time

import hydra
import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.config import ModelConfig
from gemini_jax.data import corpus
from gemini_jax.eval import needle, perplexity, unigram_bits_per_byte
from gemini_jax.eval.trials import Draw
from gemini_jax.hydra_schema import build
from gemini_jax.weights import save_safetensors
from train_tiny import ROOT, make_optimizer, restore_latest  # this script's directory is on sys.path


@hydra.main(version_base=None, config_path="../conf", config_name="train_tiny")
def main(cfg: DictConfig) -> None:
    trials = int(cfg.get("trials", 100))
    bpb_windows = int(cfg.get("bpb_windows", 8))
    out_dir = cfg.get("out_dir", tiny.ASSET_DIR)
    mcfg = build(ModelConfig, cfg.model)
    stages = OmegaConf.to_container(cfg.stages, resolve=True)
    ckpt_dir = os.path.join(ROOT, cfg.ckpt_dir) if not os.path.isabs(cfg.ckpt_dir) else cfg.ckpt_dir
    graphdef, params = nnx.split(gj.Decoder(mcfg, rngs=nnx.Rngs(0)), nnx.Param)
    opt, _ = make_optimizer(cfg, stages)
    _, step, params, _ = restore_latest(cfg, ckpt_dir, params, opt.init(params))
    if step == 0:
        raise SystemExit(f"no checkpoint in {ckpt_dir}")
    model = nnx.merge(graphdef, params)
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(model, out_dir)

    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=4096, prefill_chunk=1024, max_batch=8))
    t0 = time.time()
    lengths = sorted({int(s["seq_len"]) for s in stages if s["until"] <= step} | {int(stages[0]["seq_len"])})
    needle_acc = {}
    for L in lengths:
        res = needle(eng, [L], [0.1, 0.3, 0.5, 0.7, 0.9], trials=max(1, trials // 5), batch=8, draw=Draw("dev", 1234))
        needle_acc[str(L)] = {"accuracy": res.overall, "trials": 5 * res.trials}
        print(f"needle @{L}: {res.overall:.3f} over {5 * res.trials} trials")
    bpb = perplexity(eng, 1024, windows=bpb_windows, scored=256, draw=Draw("dev", 1234))
    uni = unigram_bits_per_byte()
    print(f"held-out bits/byte @1024: {bpb['bits_per_byte']:.3f} (unigram baseline {uni:.3f})")
    info = {
        "name": "gemini_jax tiny byte-level decoder",
        "step": step,
        "model_config": json.load(open(os.path.join(out_dir, "config.json"))),
        "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
        "train_config": OmegaConf.to_container(cfg, resolve=True),
        "corpus": corpus.manifest(),  # the per-file hashes go to corpus_manifest.json beside it
        "eval": {"needle_exact_match": needle_acc, "heldout_bits_per_byte": bpb,
                 "unigram_bits_per_byte": uni, "engine": "paged, xla, greedy",
                 "eval_seconds": time.time() - t0},
        "weights_sha256": tiny.sha256_file(os.path.join(out_dir, "model.safetensors")),
    }
    with open(os.path.join(out_dir, "card.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    with open(os.path.join(out_dir, "corpus_manifest.json"), "w") as fh:
        json.dump(corpus.manifest(per_file=True), fh, indent=0, sort_keys=True)
    print(f"exported step {step} to {out_dir}")


if __name__ == "__main__":
    main()
