"""Train the small byte-level model on the standard-library sources (Hydra + optax + Orbax + wandb).

    python experiments/train_tiny.py                       # resume from ckpt_dir if present
    python experiments/train_tiny.py max_minutes=60        # bounded run, checkpoints on exit
    python experiments/train_tiny.py ckpt_dir=/tmp/t stages='[{until:20,seq_len:128,batch:4}]'

The batch mixes language modelling, repeated spans (content-based induction) and pass-key /
key->value needles, on a curriculum of growing context. Checkpoints (params + optimizer state +
step) are Orbax; a run picks up from the latest one, so training can span sessions.
"""

from __future__ import annotations

import json
import logging
import os
import time

import hydra
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from gemini_jax.config import ModelConfig
from gemini_jax.errors import ConfigError
from gemini_jax.hydra_schema import build, register
from gemini_jax.data import corpus, ruler, tasks
from gemini_jax.model import Decoder

register()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stage_at(stages, step):
    for s in stages:
        if step < s["until"]:
            return s
    return stages[-1]


def make_batch(text, stage, mix, answer_weight, rng):
    T, B = int(stage["seq_len"]), int(stage["batch"])
    n_needle = int(round(B * mix["needle"]))
    n_multi = int(round(B * mix.get("needle_multi", 0.0)))
    n_repeat = int(round(B * mix["repeat"]))
    n_ruler = int(round(B * mix.get("ruler", 0.0)))
    toks, weights = [], []
    for i in range(B):
        if i >= B - n_ruler:  # the RULER-style tasks, one drawn per example (gemini_jax.data.ruler)
            t, w = ruler.training_example(ruler.TASKS[int(rng.integers(0, len(ruler.TASKS)))], text, T, rng,
                                          answer_weight)
        elif i < n_needle:
            t, w = tasks.needle_training_example(text, T, rng, answer_weight)
        elif i < n_needle + n_multi:
            t, w = tasks.multi_needle_training_example(text, T, rng, answer_weight, questions=max(1, T // 256))
        elif i < n_needle + n_multi + n_repeat:
            t, w = tasks.repeat_example(text, T, rng)
        else:
            t, w = tasks.lm_example(text, T, rng)
        toks.append(t)
        weights.append(w)
    return np.stack(toks), np.stack(weights)


RULER_MIN_LEN = 768  # cwe's 3 x 8 listed words and its question need about this much beside the answer


def mix_needs_length(mix) -> int:
    return RULER_MIN_LEN if float(mix.get("ruler", 0.0)) > 0 else 0


def needle_accuracy(graphdef, params, text, seq_len, trials, rng):
    """Greedy exact-match accuracy, checked teacher-forced in one forward pass (equivalent:
    greedy decoding emits the answer iff every answer byte is the argmax given the ones before)."""
    toks = []
    answers = []
    for _ in range(trials):
        ex = tasks.needle_example(text, seq_len - tasks.KEY_DIGITS, float(rng.random()), rng)
        ans = np.frombuffer(ex.answer.encode(), np.uint8).astype(np.int32)
        toks.append(np.concatenate([ex.prompt, ans]))
        answers.append(ans)
    toks = jnp.asarray(np.stack(toks))
    model = nnx.merge(graphdef, params)
    pos = jnp.broadcast_to(jnp.arange(toks.shape[1] - 1), (toks.shape[0], toks.shape[1] - 1))
    logits, _ = model(toks[:, :-1], pos)
    pred = np.asarray(jnp.argmax(logits[:, -tasks.KEY_DIGITS:], -1))
    return float(np.mean(np.all(pred == np.stack(answers), axis=1)))


def ruler_accuracy(graphdef, params, text, seq_len, trials, rng) -> dict[str, float]:
    """Per RULER-style task, the share of `trials` prompts of `seq_len` - TRAIN_MARGIN tokens whose
    target is every byte the argmax, teacher-forced (a greedy decode writes the target; stricter
    than the suite's any-order scoring, which also accepts the answers in another order)."""
    model = nnx.merge(graphdef, params)
    out = {}
    for task in ruler.TASKS:
        exs = [ruler.example(task, text, seq_len - ruler.TRAIN_MARGIN, rng) for _ in range(trials)]
        targets = [np.frombuffer(ex.target.encode(), np.uint8).astype(np.int32) for ex in exs]
        width = max(len(ex.prompt) + len(t) for ex, t in zip(exs, targets))
        toks = np.zeros((trials, width), np.int32)  # right padding: causal attention never reads it
        for i, (ex, t) in enumerate(zip(exs, targets)):
            toks[i, :len(ex.prompt) + len(t)] = np.concatenate([ex.prompt, t])
        pos = jnp.broadcast_to(jnp.arange(width - 1), (trials, width - 1))
        pred = np.asarray(jnp.argmax(model(jnp.asarray(toks[:, :-1]), pos)[0], -1))
        hits = [np.array_equal(pred[i, len(ex.prompt) - 1:len(ex.prompt) - 1 + len(t)], t)
                for i, (ex, t) in enumerate(zip(exs, targets))]
        out[task] = float(np.mean(hits))
    return out


def make_optimizer(cfg, stages):
    """AdamW with warmup + cosine decay over the whole curriculum, global-norm clipping."""
    warmup = min(int(cfg.warmup), max(1, stages[-1]["until"] // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(stages[-1]["until"], warmup + 1),
                                                  cfg.min_lr)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    return opt, schedule


def restore_latest(cfg, ckpt_dir, params, opt_state):
    """(manager, step, params, opt_state) from the newest Orbax checkpoint (step 0 if none)."""
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True))
    if mngr.latest_step() is None:
        return mngr, 0, params, opt_state
    step = int(mngr.latest_step())
    restored = mngr.restore(step, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
    return mngr, step, restored["params"], restored["opt_state"]


@hydra.main(version_base=None, config_path="../conf", config_name="train_tiny")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)
    # Orbax's per-save INFO trace would bury the progress bar (log_level=INFO shows it).
    logging.getLogger("absl").setLevel(cfg.get("log_level", "WARNING"))
    import wandb

    mcfg = build(ModelConfig, cfg.model)
    stages = OmegaConf.to_container(cfg.stages, resolve=True)
    total = int(cfg.max_steps or stages[-1]["until"])
    ckpt_dir = os.path.abspath(os.path.join(ROOT, cfg.ckpt_dir) if not os.path.isabs(cfg.ckpt_dir) else cfg.ckpt_dir)

    if mix_needs_length(cfg.mix) > min(int(s["seq_len"]) for s in stages):
        raise ConfigError(f"mix.ruler > 0 needs every stage's seq_len >= {RULER_MIN_LEN} (the shortest prompt "
                          "every RULER-style task fits); raise the stages' seq_len or set mix.ruler=0.")
    model = Decoder(mcfg, rngs=nnx.Rngs(cfg.seed))
    if cfg.get("init_from"):
        # Start from a saved model's weights (e.g. the shipped one) with a fresh optimizer: a new
        # curriculum on top of what it learnt, not a resume (that is ckpt_dir's job).
        from gemini_jax.weights import load_safetensors

        start = load_safetensors(os.path.join(ROOT, cfg.init_from) if not os.path.isabs(cfg.init_from)
                                 else cfg.init_from)
        if start.cfg != mcfg:
            raise ConfigError(f"init_from={cfg.init_from!r} holds a {start.cfg.family} model whose config differs "
                              "from model=...; train the architecture it was saved with.")
        model = start
    graphdef, params = nnx.split(model, nnx.Param)
    opt, schedule = make_optimizer(cfg, stages)
    opt_state = opt.init(params)
    mngr, step, params, opt_state = restore_latest(cfg, ckpt_dir, params, opt_state)
    if step:
        print(f"resumed from {ckpt_dir} at step {step}")

    def loss_fn(params, toks, weights, positions):
        m = nnx.merge(graphdef, params)
        logits, _ = m(toks[:, :-1], positions, remat=cfg.remat)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.sum(weights), jnp.mean(nll)

    @jax.jit
    def train_step(params, opt_state, toks, weights):
        positions = jnp.broadcast_to(jnp.arange(toks.shape[1] - 1), (toks.shape[0], toks.shape[1] - 1))
        (loss, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, toks, weights, positions)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, nll

    _, text = corpus.load_split("train")
    _, heldout = corpus.load_split("heldout")
    run = wandb.init(project=cfg.wandb.project, dir=os.path.join(ROOT, cfg.wandb.dir),
                     mode=cfg.wandb.mode, config=OmegaConf.to_container(cfg, resolve=True),
                     job_type="train_tiny", resume="allow")
    log_path = os.path.join(ckpt_dir, "train_log.jsonl")
    t_start = time.time()
    bar = tqdm(total=total, initial=step, desc="train_tiny", unit="step")
    while step < total:
        stage = stage_at(stages, step)
        # The data stream is a function of (seed, step): a resumed run sees the same batches.
        rng = np.random.default_rng([cfg.seed, step])
        toks, weights = make_batch(text, stage, cfg.mix, cfg.answer_weight, rng)
        params, opt_state, loss, nll = train_step(params, opt_state, jnp.asarray(toks), jnp.asarray(weights))
        step += 1
        bar.update(1)
        record = None
        if step % cfg.log_every == 0:
            record = {"step": step, "loss": float(loss), "bits_per_byte": float(nll) / np.log(2),
                      "seq_len": stage["seq_len"], "lr": float(schedule(step)),
                      "minutes": (time.time() - t_start) / 60}
            bar.set_postfix(loss=f"{record['loss']:.3f}", bpb=f"{record['bits_per_byte']:.3f}", T=stage["seq_len"])
        if step % cfg.eval_every == 0:
            record = record or {"step": step}
            record["needle_acc"] = needle_accuracy(graphdef, params, heldout, int(stage["seq_len"]),
                                                   cfg.eval_trials, np.random.default_rng([cfg.seed, 999, step]))
            tqdm.write(f"step {step}: needle accuracy @{stage['seq_len']} = {record['needle_acc']:.3f}")
            if float(cfg.mix.get("ruler", 0.0)) > 0:
                acc = ruler_accuracy(graphdef, params, heldout, int(stage["seq_len"]), cfg.eval_ruler_trials,
                                     np.random.default_rng([cfg.seed, 998, step]))
                record.update({f"ruler_acc/{t}": a for t, a in acc.items()})
                tqdm.write(f"step {step}: RULER-style accuracy @{stage['seq_len']}: "
                           + ", ".join(f"{t} {a:.2f}" for t, a in acc.items()))
        if record:
            run.log(record, step=step)
            with open(log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        out_of_time = cfg.max_minutes is not None and time.time() - t_start > 60 * cfg.max_minutes
        if step % cfg.save_every == 0 or step == total or out_of_time:
            mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            mngr.wait_until_finished()
        if out_of_time:
            tqdm.write(f"max_minutes={cfg.max_minutes} reached at step {step}; checkpoint saved.")
            break
    bar.close()
    mngr.wait_until_finished()
    run.finish()


if __name__ == "__main__":
    main()
