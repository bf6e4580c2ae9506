"""Train the node encoder (gemini_jax.code.encoder) and measure it where it has not been trained.

    python experiments/train_code_encoder.py                      # trains, ships the weights, writes the table
    python experiments/train_code_encoder.py steps=50 out_dir=/tmp/enc results_dir=/tmp/res   # a quick look

Knobs: conf/train_code_encoder.yaml. Training nodes come from synthetic programs of `train_seeds` in
every language, drawn from every template except the held-out ones (one per language and construct
that has two or more; gemini_jax.code.synthetic.heldout_templates). The loss is InfoNCE over pairs:
each anchor is a node of a random kind in one language, its positive a node of the same kind in
another language; every other node in the batch of another kind is a negative (same-kind nodes are
masked out of the denominator, they are not negatives).

Three measurements, each for the encoder and for its untrained input features:
- held-out seeds, seen templates: programs of `heldout_seeds` drawn from the training templates;
- held-out templates: programs of `heldout_seeds` in which every construct with a held-out template
  uses it; only the nodes those templates wrote count;
- real code: Python files of the standard library against C headers (files that parse without error).
The synthetic figures count the nodes a template instance wrote (gemini_jax.code.dataset.claim_nodes).
Writes the weights to `out_dir` and the record to <results_dir>/code/node_distances.{json,md}.
Seeded; about a CPU minute.
"""

from __future__ import annotations

import collections
import os
import sysconfig
import time

import hydra
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from gemini_jax.code import synthetic
from gemini_jax.code.dataset import NodeDataset, file_dataset, kind_distances, node_dataset, source_files
from gemini_jax.code.encoder import EncoderConfig, NodeEncoder
from gemini_jax.errors import ConfigError
from gemini_jax.eval.record import StudyResult, make_record, write_record
from gemini_jax.hydra_schema import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVALUATIONS = {  # record key -> what the table calls it
    "seen_templates": "held-out seeds, seen templates",
    "heldout_templates": "held-out templates",
    "real_code": "real code: Python stdlib vs C headers",
}
FIGURES = ("same_kind_cross_language", "different_kind_same_language")


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


def train(model: NodeEncoder, data: NodeDataset, cfg: DictConfig) -> list[float]:
    """`cfg.steps` AdamW steps of the InfoNCE loss on pairs drawn from `data`; the losses."""
    draw = pair_sampler(data.kinds, data.languages, np.random.default_rng(cfg.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=cfg.weight_decay), wrt=nnx.Param)
    x = jnp.asarray(data.x)

    @nnx.jit
    def step(model, optimizer, anchors, positives, ids):
        def loss_fn(model):
            return info_nce(model(jnp.concatenate([x[anchors], x[positives]])), ids, cfg.temperature)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = []
    for _ in (bar := tqdm(range(cfg.steps), desc="train code encoder")):
        anchors, positives, ids = draw(cfg.batch)
        losses.append(float(step(model, optimizer, jnp.asarray(anchors), jnp.asarray(positives), jnp.asarray(ids))))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def roots(entries) -> list[str]:
    """Directories of the real-code roots: "stdlib" and "include" name sysconfig's paths."""
    named = {"stdlib": sysconfig.get_paths()["stdlib"], "include": sysconfig.get_paths()["include"]}
    return [named.get(entry, entry) for entry in entries]


def real_code(cfg: DictConfig, size: int) -> tuple[NodeDataset, dict]:
    """Nodes of the Python and C files of `cfg.real_code`, and what was read."""
    real = cfg.real_code
    parts, facts = [], {}
    for language, suffix, entries in (("python", ".py", real.python_roots), ("c", ".h", real.c_roots)):
        dirs = roots(entries)
        paths, skipped = source_files(dirs, suffix, language, real.files, real.seed, max_bytes=real.max_bytes)
        parts.append(file_dataset(paths, language, size, max_nodes_per_kind=real.max_nodes_per_kind, seed=real.seed))
        # The roots as configured ("stdlib", "include": sysconfig's), not this machine's paths.
        facts[language] = {"roots": [str(entry) for entry in entries], "files": len(paths), "skipped_unparsable": skipped,
                           "files_per_root": [sum(path.startswith(os.path.join(root, "")) for path in paths)
                                              for root in dirs],
                           "nodes": len(parts[-1])}
    return NodeDataset.concatenate(parts), facts


def measure(model: NodeEncoder, data: NodeDataset) -> dict:
    """kind_distances of the encoder's vectors and of the raw features, and the set's size."""
    encoded = np.asarray(model(jnp.asarray(data.x)))
    return {"nodes": len(data), "encoder": kind_distances(encoded, data.kinds, data.languages),
            "features": kind_distances(data.x, data.kinds, data.languages)}


def job_command() -> str:
    """The command line that reproduces this run: the script and its Hydra overrides."""
    return " ".join(["python experiments/train_code_encoder.py", *HydraConfig.get().overrides.task])


def in_checkout(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


@hydra.main(version_base=None, config_path="../conf", config_name="train_code_encoder")
def main(cfg: DictConfig) -> None:
    started = time.time()
    config = build(EncoderConfig, cfg.encoder)
    heldout = synthetic.heldout_templates(cfg.heldout_template_seed)
    train_seeds, heldout_seeds = range(*cfg.train_seeds), range(*cfg.heldout_seeds)
    if set(train_seeds) & set(heldout_seeds):
        raise ConfigError(f"train_seeds={list(cfg.train_seeds)} and heldout_seeds={list(cfg.heldout_seeds)} "
                         "overlap; held-out programs must be unseen.")

    data = node_dataset(train_seeds, config.features, heldout=heldout, draw="seen")
    assert not data.heldout.any(), "training programs hold no held-out template"
    # No held-out template is drawn in training, but its kind can still occur there inside another
    # template's text (a call in an expression, the declaration in a for header): say where.
    unclaimed = data.templates == ""
    heldout_kinds = {(t.language, synthetic.CONSTRUCT_KINDS[t.construct]) for t in heldout}
    nested = collections.Counter(f"{language}:{kind}" for kind, language in
                                 zip(data.kinds[unclaimed].tolist(), data.languages[unclaimed].tolist())
                                 if (language, kind) in heldout_kinds)
    model = NodeEncoder(config, rngs=nnx.Rngs(cfg.seed))
    losses = train(model, data, cfg)

    seen = node_dataset(heldout_seeds, config.features, heldout=heldout, draw="seen")
    unseen = node_dataset(heldout_seeds, config.features, heldout=heldout, draw="heldout")
    real, real_facts = real_code(cfg, config.features)
    results = {"seen_templates": measure(model, seen.subset(seen.templates != "")),
               "heldout_templates": measure(model, unseen.subset(unseen.heldout)),
               "real_code": measure(model, real)}

    facts = {"train_nodes": len(data), "train_seeds": list(cfg.train_seeds), "heldout_seeds": list(cfg.heldout_seeds),
             "heldout_template_seed": cfg.heldout_template_seed, "steps": cfg.steps,
             "final_loss": float(np.mean(losses[-20:]))}
    out_dir = in_checkout(cfg.out_dir)
    model.save(out_dir, extra={"training": facts})

    rows = [{"evaluation": evaluation, "kind": kind, "languages": row["languages"],
             **{f"encoder_{figure}": row[figure] for figure in FIGURES},
             **{f"features_{figure}": result["features"]["per_kind"][kind][figure] for figure in FIGURES}}
            for evaluation, result in results.items() for kind, row in result["encoder"]["per_kind"].items()]
    summary = {evaluation: {"nodes": result["nodes"], "kinds": len(result["encoder"]["per_kind"]),
                            **{f"{source}_{figure}": result[source][figure] for source in ("encoder", "features")
                               for figure in FIGURES}}
               for evaluation, result in results.items()}
    extra = {**facts, "languages": sorted(set(seen.languages.tolist())), "summary": summary,
             "heldout_templates": sorted(map(str, heldout)),
             "heldout_kinds_nested_in_training": dict(sorted(nested.items())),
             "templates": sum(len(synthetic.all_templates(language)) for language in synthetic.TEMPLATES),
             "real_code": real_facts, "minutes": round((time.time() - started) / 60, 2)}
    record = make_record("code", StudyResult(name="node_distances", records=rows, split=None, seeds=[cfg.seed],
                                             extra=extra),
                         command=job_command(), config=OmegaConf.to_container(cfg, resolve=True))
    paths = write_record(in_checkout(cfg.results_dir), record, markdown(record))
    for evaluation, row in summary.items():
        print(f"{EVALUATIONS[evaluation]}: same kind, other language {row['encoder_same_kind_cross_language']:.3f} | "
              f"different kind, same language {row['encoder_different_kind_same_language']:.3f}")
    print(f"weights -> {out_dir}, table -> {paths['md']}")


def _figures(row: dict) -> str:
    return " | ".join(f"{row[f'{source}_{figure}']:.3f}" for source in ("encoder", "features") for figure in FIGURES)


def markdown(record: dict) -> str:
    summary, real = record["summary"], record["real_code"]
    lines = [
        "# Node encoder: cosine distances where it was not trained",
        "",
        f"Commit `{record['commit']}`, `{record['command']}`. {len(record['languages'])} languages "
        f"({', '.join(record['languages'])}); training: {record['train_nodes']} nodes of programs with seeds "
        f"{record['train_seeds'][0]}..{record['train_seeds'][1] - 1}, drawn from "
        f"{record['templates'] - len(record['heldout_templates'])} of the {record['templates']} templates (one "
        f"template of each language's constructs that have two or more is held out, "
        f"{len(record['heldout_templates'])} in all, by synthetic.heldout_templates("
        f"{record['heldout_template_seed']})). "
        f"Knobs as in conf/train_code_encoder.yaml; none were tuned on the held-out templates or the real code.",
        "",
        "Mean cosine distance (1 - cos) between groups of nodes (one kind in one language; each group pair "
        "counts once). *Cross*: the same kind in two different languages, lower is better. *Within*: two "
        "different kinds in one language, higher is better. *Features*: the hashed input features themselves, "
        "before the encoder.",
        "",
        f"- *{EVALUATIONS['seen_templates']}*: programs of seeds {record['heldout_seeds'][0]}.."
        f"{record['heldout_seeds'][1] - 1} drawn from the training templates.",
        f"- *{EVALUATIONS['heldout_templates']}*: programs of the same seeds in which every construct with a "
        "held-out template uses it; only the nodes those templates wrote count, so a kind appears for the "
        "languages where one of its templates is held out. No held-out template is drawn in training, but "
        "its kind can occur there inside another template's text (a call inside an expression, the "
        "declaration of a for header, an impl block beside a struct); training nodes of that kind nested so, "
        "per language: " + ", ".join(f"{key} {n}" for key, n in record["heldout_kinds_nested_in_training"].items())
        + ".",
        f"- *{EVALUATIONS['real_code']}*: {real['python']['files']} Python files of the standard library and "
        f"{real['c']['files']} C headers ("
        f"{', '.join(f'{n} from {root}' for n, root in zip(real['c']['files_per_root'], real['c']['roots']))}), "
        f"the roots read in order, each in a seeded shuffle, keeping files "
        f"that parse without error ({real['python']['skipped_unparsable']} Python and "
        f"{real['c']['skipped_unparsable']} C files skipped on the way), at most "
        f"{record['config']['real_code']['max_nodes_per_kind']} nodes per language and kind. Cross: Python vs C.",
        "",
        "In the synthetic sets a node counts when a template instance wrote it (dataset.claim_nodes): the "
        "constructs, not the blocks, operators and literals around them.",
        "",
        "| evaluation | nodes | kinds | encoder: cross | encoder: within | features: cross | features: within |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for evaluation, label in EVALUATIONS.items():
        row = summary[evaluation]
        lines.append(f"| {label} | {row['nodes']} | {row['kinds']} | {_figures(row)} |")
    for evaluation, label in EVALUATIONS.items():
        lines += ["", f"## {label[0].upper()}{label[1:]}, per kind", "",
                  "| kind | languages | encoder: cross | encoder: within | features: cross | features: within |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {row['kind']} | {row['languages']} | {_figures(row)} |"
                  for row in record["records"] if row["evaluation"] == evaluation]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
