"""Study `needle_keys`: dense needle accuracy on chosen keys, by length and depth. Does the model
itself copy a key right when the needle sits near the edge of its training window?

Per (length, depth) how many keys came back exactly, and the wrong answers. The shipped tiny model,
dense attention through the paged engine (no sparsity); one batch of keys per cell.
"""

from __future__ import annotations

from dataclasses import dataclass


import gemini_jax as gj
from gemini_jax.data import tasks
from gemini_jax.errors import ConfigError
from gemini_jax.eval.needle import is_correct
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import as_tuple
from gemini_jax.tokenizer import ByteTokenizer
from gemini_jax.eval.trials import Draw

# Keys that sparse runs with compact positions miscopied at 8K / 32K (most repeat a digit).
DEFAULT_KEYS = ("22679", "78734", "22245", "84037", "86812", "36113", "68623", "44920", "83793")


@dataclass(frozen=True, kw_only=True)
class Config:
    keys: tuple[str, ...] = DEFAULT_KEYS
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.05, 0.5, 0.95)
    seed: int = 7
    out_name: str = "needle_keys"

    def __post_init__(self):
        as_tuple(self, "keys", str)
        as_tuple(self, "lengths", int)
        as_tuple(self, "depths", float)
        bad = [k for k in self.keys if len(k) != tasks.KEY_DIGITS or not k.isdigit()]
        if bad:
            raise ConfigError(f"needle_keys keys must be {tasks.KEY_DIGITS} digits: {bad}")


def run(cfg: Config) -> StudyResult:
    """One dense engine, batch = the keys; trial i of a cell draws its haystack window from seed [seed, i]."""
    hay = heldout_text()
    eng = gj.Engine(gj.load_tiny(), gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=max(cfg.lengths) + 16, max_batch=len(cfg.keys), prefill_chunk=1024)))
    tok = ByteTokenizer()
    params = gj.SamplingParams(max_new_tokens=tasks.KEY_DIGITS + 1, temperature=0.0, stop_at_eos=False)
    rows = []
    for length in cfg.lengths:
        for depth in cfg.depths:
            exs = [tasks.needle_example(hay, length, depth, Draw("dev", cfg.seed).rng(i), key=k)
                   for i, k in enumerate(cfg.keys)]
            out = eng.generate([list(map(int, e.prompt)) for e in exs], params)
            got = [tok.decode([t for t in g if t < 256]) for g in out.tokens]
            wrong = [(k, g) for k, g in zip(cfg.keys, got) if not is_correct(g, k)]
            rows.append({"length": length, "depth": depth, "right": len(cfg.keys) - len(wrong), "of": len(cfg.keys),
                         "wrong": wrong})
            print(f"{length:6d} {depth:.2f} {len(cfg.keys) - len(wrong)}/{len(cfg.keys)} {wrong}", flush=True)
    return StudyResult(name=cfg.out_name, records=rows, split="dev", seeds=[cfg.seed],
                       extra={"keys": list(cfg.keys)})


def markdown(record: dict) -> str:
    lines = ["# Dense needle on chosen keys", "",
             f"Run {record['date']}, command `{record['command']}`. "
             f"The shipped tiny model, dense attention; keys {', '.join(record['keys'])}.", "",
             "| length | depth | right | wrong answers (key → answer) |", "|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['depth']} | {r['right']} / {r['of']} | "
              + (", ".join(f"{k} → `{g!r}`" for k, g in r["wrong"]) or "—") + " |" for r in record["records"]]
    return "\n".join(lines) + "\n"
