"""Train the shipped image encoders and their projectors into the frozen tiny decoder, and measure them
on held-out digits.

    python experiments/train_encoders.py                  # trains, ships gemini_jax/assets/encoders/*, writes the table
    python experiments/train_encoders.py pretrain.steps=20 projector.steps=5 out_dir=/tmp/enc results_dir=/tmp/res

Knobs: conf/train_encoders.yaml. For each encoder (a CNN and an MLP-mixer, gemini_jax.encoders):
1. pretrain it as a digit classifier (a linear head on its mean output vector) on the training split;
2. freeze it, and train a projector from its vectors to the decoder's hidden size so that the shipped
   decoder, given [BOS] + soft tokens + " The digit is ", continues with the digit's byte
   (cross-entropy on that byte). The decoder's weights are never updated: their sha256 is taken
   before and after and must match;
3. measure on the held-out split: the greedy next byte (exact answer), with a 95% Wilson interval,
   and the classifier head's accuracy.
Then the swap: the second encoder's vectors through its own projector (its accuracy above) and
through the first encoder's projector, which must be refused (EncoderError).
Writes the assets to `out_dir` and the record to <results_dir>/encoders/digits.{json,md}. Seeded.
"""

from __future__ import annotations

import os
import time

import hydra
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.encoders import Projector, ProjectorConfig, build_encoder, check_pair, digits, save_paired, task
from gemini_jax.encoders.base import ImageEncoder, validate_images
from gemini_jax.errors import ConfigError, EncoderError
from gemini_jax.eval.intervals import wilson
from gemini_jax.eval.record import StudyResult, make_record, write_record
from gemini_jax.weights.native import params_sha256

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batches(rows: np.ndarray, batch: int, steps: int, rng: np.random.Generator):
    """`steps` batches of `rows`, shuffled epoch after epoch (every row once per epoch)."""
    order = np.array([], int)
    for _ in range(steps):
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(rows)])
        yield order[:batch]
        order = order[batch:]


def pretrain(encoder: ImageEncoder, x: np.ndarray, labels: np.ndarray, rows: np.ndarray, cfg: DictConfig,
             rng: np.random.Generator, desc: str) -> float:
    """AdamW on the classifier's cross-entropy over training `rows`; the last 20 steps' mean loss."""
    optimizer = nnx.Optimizer(encoder, optax.adamw(cfg.lr, weight_decay=cfg.weight_decay), wrt=nnx.Param)

    @nnx.jit
    def step(encoder, optimizer, xb, yb):
        def loss_fn(encoder):
            return optax.softmax_cross_entropy_with_integer_labels(encoder.classify_logits(xb), yb).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(encoder)
        optimizer.update(encoder, grads)
        return loss

    losses = []
    for batch in (bar := tqdm(batches(rows, cfg.batch, cfg.steps, rng), total=cfg.steps, desc=desc)):
        losses.append(float(step(encoder, optimizer, jnp.asarray(x[batch]), jnp.asarray(labels[batch]))))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return float(np.mean(losses[-20:]))


def train_projector(decoder, projector: Projector, vectors: np.ndarray, labels: np.ndarray, rows: np.ndarray,
                    cfg: DictConfig, rng: np.random.Generator, desc: str) -> float:
    """AdamW on the answer byte's cross-entropy, the decoder frozen (only `projector` is differentiated
    and updated); the last 20 steps' mean loss."""
    optimizer = nnx.Optimizer(projector, optax.adamw(cfg.lr, weight_decay=cfg.weight_decay), wrt=nnx.Param)
    targets = task.answer_token(labels)

    @nnx.jit
    def step(projector, optimizer, decoder, vb, tb):
        def loss_fn(projector):
            logits = task.answer_logits(decoder, projector, vb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tb).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(projector)
        optimizer.update(projector, grads)
        return loss

    losses = []
    for batch in (bar := tqdm(batches(rows, cfg.batch, cfg.steps, rng), total=cfg.steps, desc=desc)):
        losses.append(float(step(projector, optimizer, decoder, jnp.asarray(vectors[batch]),
                                 jnp.asarray(targets[batch]))))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return float(np.mean(losses[-20:]))


def answer_hits(decoder, projector: Projector, vectors: np.ndarray, labels: np.ndarray, chunk: int = 128) -> int:
    """How many images' greedy next byte after the question is their digit."""
    run = nnx.jit(task.answer_logits)
    hits = 0
    for start in range(0, len(labels), chunk):
        logits = run(decoder, projector, jnp.asarray(vectors[start:start + chunk]))
        hits += int((np.asarray(logits).argmax(-1) == task.answer_token(labels[start:start + chunk])).sum())
    return hits


def decoder_sha256(decoder) -> str:
    return params_sha256(nnx.state(decoder, nnx.Param))


def proportion(hits: int, n: int) -> dict:
    low, high = wilson(hits, n)
    return {"hits": hits, "n": n, "accuracy": hits / n, "ci95": [low, high]}


def job_command() -> str:
    return " ".join(["python experiments/train_encoders.py", *HydraConfig.get().overrides.task])


def in_checkout(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


@hydra.main(version_base=None, config_path="../conf", config_name="train_encoders")
def main(cfg: DictConfig) -> None:
    started = time.time()
    if len(cfg.encoders) != 2:
        raise ConfigError(f"encoders lists {sorted(cfg.encoders)}; the swap check needs exactly two.")
    data = digits.load()
    train_rows, heldout_rows = digits.split(data.labels, seed=cfg.split.seed,
                                            heldout_fraction=cfg.split.heldout_fraction)
    x, _ = validate_images(data.images)
    decoder = gj.load_tiny()
    sha_before = decoder_sha256(decoder)

    rows, trained = [], {}
    for offset, (name, spec) in enumerate(cfg.encoders.items()):
        rng = np.random.default_rng([cfg.seed, offset])
        encoder = build_encoder(spec.kind, OmegaConf.to_container(spec.config), seed=cfg.seed + offset)
        pretrain_loss = pretrain(encoder, x, data.labels, train_rows, cfg.pretrain, rng, f"pretrain {name}")
        vectors = np.asarray(encoder.encode(data.images))      # frozen from here on: computed once
        projector = Projector(ProjectorConfig(d_enc=encoder.d_enc, d_model=decoder.cfg.hidden_size,
                                              hidden=cfg.projector.hidden),
                              encoder_fingerprint=encoder.fingerprint, encoder_name=name,
                              rngs=nnx.Rngs(cfg.seed + offset))
        projector_loss = train_projector(decoder, projector, vectors, data.labels, train_rows, cfg.projector, rng,
                                         f"projector {name}")
        answer = proportion(answer_hits(decoder, projector, vectors[heldout_rows], data.labels[heldout_rows]),
                            len(heldout_rows))
        train_answer = proportion(answer_hits(decoder, projector, vectors[train_rows], data.labels[train_rows]),
                                  len(train_rows))
        classifier = proportion(int((encoder.classify(data.images[heldout_rows]) == data.labels[heldout_rows]).sum()),
                                len(heldout_rows))
        row = {"encoder": name, "kind": spec.kind, "d_enc": encoder.d_enc, "soft_tokens": encoder.n_vectors,
               "encoder_fingerprint": encoder.fingerprint, "heldout_answer": answer,
               "train_answer": train_answer, "heldout_classifier": classifier,
               "pretrain_final_loss": pretrain_loss, "projector_final_loss": projector_loss,
               "goal_met": answer["accuracy"] >= cfg.goal}
        rows.append(row)
        trained[name] = (encoder, projector, vectors)

    sha_after = decoder_sha256(decoder)
    (name_a, (_, projector_a, _)), (name_b, (encoder_b, projector_b, vectors_b)) = trained.items()
    try:
        check_pair(encoder_b, projector_a, name_b)
        refusal = None
    except EncoderError as exc:
        refusal = str(exc)
    swap = {"encoder": name_b, "own_projector_heldout_answer": rows[1]["heldout_answer"],
            "projector_of": name_a, "refused": refusal is not None, "error": refusal}

    split = {"source": "sklearn.datasets.load_digits", "seed": cfg.split.seed,
             "heldout_fraction": cfg.split.heldout_fraction, "rule": "digits.split: per digit, "
             "numpy.random.default_rng([seed, digit]).permutation; the first round(fraction * count) are held out",
             "train": len(train_rows), "heldout": len(heldout_rows)}
    out_dir = in_checkout(cfg.out_dir)
    for row in rows:
        encoder, projector, _ = trained[row["encoder"]]
        card = {"name": row["encoder"], "modality": "image", "question": task.QUESTION, "split": split,
                "decoder": "gemini_jax.load_tiny()", "decoder_sha256": sha_before,
                **{key: row[key] for key in ("kind", "d_enc", "soft_tokens", "encoder_fingerprint", "heldout_answer",
                                             "train_answer", "heldout_classifier")},
                "config": {"encoder": OmegaConf.to_container(cfg.encoders[row["encoder"]]),
                           "pretrain": OmegaConf.to_container(cfg.pretrain),
                           "projector": OmegaConf.to_container(cfg.projector), "seed": cfg.seed}}
        save_paired(os.path.join(out_dir, row["encoder"]), row["encoder"], encoder, projector, card)
    sizes = {row["encoder"]: sum(os.path.getsize(os.path.join(out_dir, row["encoder"], f))
                                 for f in os.listdir(os.path.join(out_dir, row["encoder"]))) for row in rows}

    extra = {"split_facts": split, "decoder_sha256_before": sha_before, "decoder_sha256_after": sha_after,
             "decoder_unchanged": sha_before == sha_after, "swap": swap, "goal": cfg.goal,
             "asset_bytes": sizes, "minutes": round((time.time() - started) / 60, 2)}
    record = make_record("encoders", StudyResult(name="digits", records=rows, split=None, seeds=[cfg.seed],
                                                 extra=extra),
                         command=job_command(), config=OmegaConf.to_container(cfg, resolve=True))
    paths = write_record(in_checkout(cfg.results_dir), record, markdown(record))
    for row in rows:
        answer = row["heldout_answer"]
        print(f"{row['encoder']}: held-out answer {answer['accuracy']:.3f} "
              f"[{answer['ci95'][0]:.3f}, {answer['ci95'][1]:.3f}], classifier "
              f"{row['heldout_classifier']['accuracy']:.3f}")
    print(f"decoder unchanged: {sha_before == sha_after}; swap refused: {swap['refused']}")
    print(f"assets -> {out_dir}, table -> {paths['md']}")


def _pct(p: dict) -> str:
    return f"{100 * p['accuracy']:.1f}% [{100 * p['ci95'][0]:.1f}, {100 * p['ci95'][1]:.1f}] ({p['hits']}/{p['n']})"


def markdown(record: dict) -> str:
    split, swap = record["split_facts"], record["swap"]
    lines = [
        "# Image encoders into the frozen tiny decoder: held-out digits",
        "",
        f"Commit `{record['commit']}`, `{record['command']}`. Data: {split['source']}, {split['train']} training "
        f"and {split['heldout']} held-out images (split seed {split['seed']}, {split['rule']}). "
        "Knobs as in conf/train_encoders.yaml; none were tuned on the held-out images.",
        "",
        "Each encoder was pretrained as a classifier (linear head on its mean output vector), then frozen; a "
        "projector trained on the training images maps its vectors to soft tokens. The decoder "
        "(`gemini_jax.load_tiny()`) reads [BOS] + soft tokens + `\" The digit is \"`; *answer* counts an image "
        "right when the greedy next byte is its digit. 95% Wilson intervals. Goal: answer accuracy >= "
        f"{100 * record['goal']:.0f}% with either encoder.",
        "",
        "| encoder | d_enc | soft tokens | held-out answer | goal | train answer | held-out classifier |",
        "| --- | ---: | ---: | ---: | :---: | ---: | ---: |",
    ]
    for row in record["records"]:
        lines.append(f"| {row['encoder']} ({row['kind']}) | {row['d_enc']} | {row['soft_tokens']} | "
                     f"{_pct(row['heldout_answer'])} | {'✓' if row['goal_met'] else '✗'} | "
                     f"{_pct(row['train_answer'])} | {_pct(row['heldout_classifier'])} |")
    same = "identical" if record["decoder_unchanged"] else "CHANGED"
    lines += [
        "",
        f"Decoder weights' sha256 before training `{record['decoder_sha256_before'][:16]}…`, after "
        f"`{record['decoder_sha256_after'][:16]}…`: {same} {'✓' if record['decoder_unchanged'] else '✗'}.",
        "",
        f"Swap: encoder {swap['encoder']!r} with its own projector answers {_pct(swap['own_projector_heldout_answer'])}; "
        f"with the projector of {swap['projector_of']!r}: "
        + (f"refused ✓ (`EncoderError: {swap['error']}`)." if swap["refused"] else "NOT refused ✗."),
        "",
        "Shipped files per encoder (gemini_jax/assets/encoders/<name>/): "
        + ", ".join(f"{name} {size / 1024:.0f} KiB" for name, size in record["asset_bytes"].items()) + ".",
    ]
    for row in record["records"]:
        lines.append(f"Fingerprint of {row['encoder']}: `{row['encoder_fingerprint']}`.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
