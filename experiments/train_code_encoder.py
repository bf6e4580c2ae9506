"""Train the node encoder (gemini_jax.code.encoder) and measure it on held-out programs.

    python experiments/train_code_encoder.py            # trains, ships the weights, writes the table
    python experiments/train_code_encoder.py --steps 50 --out /tmp/enc --results /tmp/res   # a quick look

Training nodes come from synthetic programs of TRAIN_SEEDS in every language, evaluation nodes from
HELDOUT_SEEDS (gemini_jax.code.dataset). The loss is InfoNCE over pairs: each anchor is a node of a
random kind in one language, its positive a node of the same kind in another language; every other
node in the batch of another kind is a negative (same-kind nodes are masked out of the denominator,
they are not negatives). Writes the weights to gemini_jax/assets/code_encoder/ and the distance table
to experiments/results/code/node_distances.{json,md}, the untrained features beside the encoder.
Seeded; a few CPU minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from gemini_jax.code.dataset import HELDOUT_SEEDS, TRAIN_SEEDS, kind_distances, node_dataset
from gemini_jax.code.encoder import ASSET_DIR, EncoderConfig, NodeEncoder
from gemini_jax.eval import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_commit(files: list[str]) -> str:
    """HEAD, with "+dirty" when one of `files` (the code this run imported) has uncommitted changes.
    Other files of the checkout (a training job's checkpoints) do not make this run's figures
    unreproducible."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def pair_sampler(kinds: np.ndarray, languages: np.ndarray, rng: np.random.Generator):
    """draw(batch) -> (anchor rows, positive rows, kind ids): same kind, different languages."""
    groups: dict[str, dict[str, np.ndarray]] = {}
    for kind in np.unique(kinds):
        by_lang = {lang: np.flatnonzero((kinds == kind) & (languages == lang)) for lang in np.unique(languages)}
        by_lang = {lang: rows for lang, rows in by_lang.items() if len(rows)}
        if len(by_lang) > 1:
            groups[kind] = by_lang
    names = sorted(groups)

    def draw(batch: int):
        anchors, positives, ids = [], [], []
        for _ in range(batch):
            k = int(rng.integers(len(names)))
            a, b = rng.choice(sorted(groups[names[k]]), size=2, replace=False)
            anchors.append(rng.choice(groups[names[k]][a]))
            positives.append(rng.choice(groups[names[k]][b]))
            ids.append(k)
        return np.array(anchors), np.array(positives), np.array(ids)

    return draw


def info_nce(z: jax.Array, ids: jax.Array, temperature: float) -> jax.Array:
    """NT-Xent over 2B unit vectors z (anchors then positives); ids: kind id of each of the B pairs."""
    batch = ids.shape[0]
    labels = jnp.concatenate([ids, ids])
    logits = z @ z.T / temperature
    partner = jnp.concatenate([jnp.arange(batch) + batch, jnp.arange(batch)])
    same_kind = labels[:, None] == labels[None, :]
    keep = ~same_kind | (jnp.arange(2 * batch)[None, :] == partner[:, None])  # negatives + the partner
    logits = jnp.where(keep, logits, -1e9)
    return -jnp.mean(jax.nn.log_softmax(logits, axis=-1)[jnp.arange(2 * batch), partner])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=ASSET_DIR)
    parser.add_argument("--results", default=os.path.join(ROOT, "experiments", "results"))
    args = parser.parse_args(argv)
    config = EncoderConfig()
    started = time.time()

    train = node_dataset(TRAIN_SEEDS, config.features)
    heldout = node_dataset(HELDOUT_SEEDS, config.features)
    draw = pair_sampler(train.kinds, train.languages, np.random.default_rng(args.seed))
    model = NodeEncoder(config, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=1e-4), wrt=nnx.Param)
    x_train = jnp.asarray(train.x)

    @nnx.jit
    def step(model, optimizer, anchors, positives, ids):
        def loss_fn(model):
            return info_nce(model(jnp.concatenate([x_train[anchors], x_train[positives]])), ids, args.temperature)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = []
    for _ in (bar := tqdm(range(args.steps), desc="train code encoder")):
        anchors, positives, ids = draw(args.batch)
        losses.append(float(step(model, optimizer, jnp.asarray(anchors), jnp.asarray(positives), jnp.asarray(ids))))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")

    trained = kind_distances(np.asarray(model(jnp.asarray(heldout.x))), heldout.kinds, heldout.languages)
    baseline = kind_distances(heldout.x, heldout.kinds, heldout.languages)
    facts = {"train_nodes": int(len(train.kinds)), "heldout_nodes": int(len(heldout.kinds)),
             "train_seeds": [TRAIN_SEEDS.start, TRAIN_SEEDS.stop], "heldout_seeds": [HELDOUT_SEEDS.start,
                                                                                   HELDOUT_SEEDS.stop],
             "steps": args.steps, "final_loss": float(np.mean(losses[-20:]))}
    model.save(args.out, extra={"training": facts})

    rec = {"study": "code", "name": "node_distances", "date": record.utc_now(),
           "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *(argv or sys.argv[1:])]),
           "config": {**vars(args), "out": os.path.relpath(args.out, ROOT), "results": None,
                      "encoder": {"features": config.features, "hidden": config.hidden, "dim": config.dim}},
           "commit": code_commit(record.code_files()), "code": record.code_files(), "split": "test",
           "seeds": [args.seed, HELDOUT_SEEDS.start], **facts, "minutes": round((time.time() - started) / 60, 2),
           "languages": sorted(set(heldout.languages.tolist())),
           "encoder": trained, "hashed_features": baseline,
           "records": [{"kind": kind, "languages": row["languages"], **{f"encoder_{k}": row[k] for k in
                        ("same_kind_cross_language", "different_kind_same_language")},
                        **{f"features_{k}": baseline["per_kind"][kind][k] for k in
                           ("same_kind_cross_language", "different_kind_same_language")}}
                       for kind, row in trained["per_kind"].items()]}
    paths = record.write_record(args.results, rec, markdown(rec))
    print(f"same kind, other language {trained['same_kind_cross_language']:.3f} | different kind, same language "
          f"{trained['different_kind_same_language']:.3f} -> {paths['md']}")
    return 0


def markdown(rec: dict) -> str:
    enc, raw = rec["encoder"], rec["hashed_features"]
    lines = [
        "# Node encoder: cosine distances on held-out programs",
        "",
        f"Commit `{rec['commit']}`, `{rec['command']}`. {len(rec['languages'])} languages "
        f"({', '.join(rec['languages'])}), {rec['heldout_nodes']} held-out nodes from seeds "
        f"{rec['heldout_seeds'][0]}..{rec['heldout_seeds'][1] - 1} (training: {rec['train_nodes']} nodes, seeds "
        f"{rec['train_seeds'][0]}..{rec['train_seeds'][1] - 1}).",
        "",
        "Mean cosine distance (1 - cos) between groups of nodes (one kind in one language; each group pair "
        "counts once). *Cross-language*: the same kind in two different languages, lower is better. "
        "*Within-language*: two different kinds in one language, higher is better. *Features*: the hashed "
        "input features themselves, before the encoder.",
        "",
        "| kind | languages | encoder: same kind, cross-language | encoder: different kind, same language "
        "| features: cross-language | features: within-language |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rec["records"]:
        lines.append(f"| {row['kind']} | {row['languages']} | {row['encoder_same_kind_cross_language']:.3f} "
                     f"| {row['encoder_different_kind_same_language']:.3f} "
                     f"| {row['features_same_kind_cross_language']:.3f} "
                     f"| {row['features_different_kind_same_language']:.3f} |")
    lines.append(f"| **mean over kinds** | | **{enc['same_kind_cross_language']:.3f}** "
                 f"| **{enc['different_kind_same_language']:.3f}** | {raw['same_kind_cross_language']:.3f} "
                 f"| {raw['different_kind_same_language']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
