"""The main job (`make run`): load a model, run the selected experiment, print a short table.

    python experiments/run.py                                  # shipped tiny model, generate
    python experiments/run.py weights=/path/to/hf_dir model=llama3_1_8b sampling.max_new_tokens=32
    python experiments/run.py experiment=generate experiment.prompt='import os'
    python experiments/run.py experiment=needle_keys experiment.lengths=[1024]   # a study

Every job logs its config and counters to wandb (offline by default; WANDB_MODE=online works)
and writes `result.json` into its Hydra output directory. A study (conf/experiment/<study>.yaml,
workload in gemini_jax.eval.studies) also writes its record, `<results>/<study>/<name>.json` and
`.md` (gemini_jax.eval.record). `<results>` is the job's own output directory unless
`results_dir=` names another: a job never rewrites the committed records under
experiments/results/ unless asked to (`make results` asks).
"""

from __future__ import annotations

import json
import logging
import os
import time

import hydra
import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.config import EngineConfig, HardwareConfig, ModelConfig, SamplingParams
from gemini_jax.eval import studies
from gemini_jax.eval.record import StudyResult, make_record, provenance, write_record
from gemini_jax.eval.trials import Draw
from gemini_jax.hydra_schema import build, one_line_errors, register

register()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_choice() -> str | None:
    """The `model=` preset this job runs (conf/model/<name>.yaml), None outside a Hydra job."""
    try:
        return hydra.core.hydra_config.HydraConfig.get().runtime.choices.get("model")
    except ValueError:
        return None


def load_model(cfg: DictConfig):
    """(model, tokenizer, description) for the job's `weights` / `model` settings: HF weights when
    `weights` is set, a pretrained model when the preset names one (model=smollm2_135m), the shipped
    tiny model, or a random one for the small shapes."""
    if cfg.weights:
        model = gj.load_hf(cfg.weights, dtype=cfg.model.dtype)
        return model, gj.HFTokenizer(cfg.weights), f"HF weights from {cfg.weights}"
    from gemini_jax.weights.pretrained import pretrained_for_preset

    name = pretrained_for_preset(model_choice() or "")
    if name:
        model, tok = gj.load_pretrained(name, dtype=cfg.model.dtype)
        return model, tok, f"{name} ({cfg.model.dtype}, {gj.pretrained_path(name).rsplit('/', 1)[-1]})"
    mcfg = build(ModelConfig, cfg.model)
    if mcfg.family == "tiny" and tiny.available():
        return gj.load_tiny(), gj.ByteTokenizer(), "shipped tiny model (gj.load_tiny())"
    if mcfg.num_params() > 50_000_000:
        raise gj.errors.ConfigError(
            f"model={mcfg.family} has {mcfg.num_params() / 1e9:.1f}B parameters and no weights were given; "
            f"set weights=/path/to/hf_dir (random init is only offered for small models).")
    from flax import nnx

    model = gj.Decoder(mcfg, rngs=nnx.Rngs(cfg.seed))
    return model, gj.ByteTokenizer(), "RANDOMLY INITIALISED model (no trained weights available): output is noise"


def run_generate(cfg, model, tok, desc):
    ecfg = emulate_hardware(cfg, build(EngineConfig, cfg.engine), model)[0]
    params = build(SamplingParams, cfg.sampling)
    eng = gj.Engine(model, ecfg)
    prompt = tok.encode(cfg.experiment.prompt, bos=True)
    t0 = time.perf_counter()
    out = eng.generate(prompt, params)
    wall = time.perf_counter() - t0
    text = tok.decode(out.tokens)
    decode_tps = max(len(out.tokens) - 1, 0) / max(out.seconds["decode"], 1e-9)
    print(f"model: {desc}")
    print("-" * 60)
    print(cfg.experiment.prompt + text)
    print("-" * 60)
    rows = [("prompt tokens", len(prompt)), ("generated tokens", len(out.tokens)),
            ("prefill s", f"{out.seconds['prefill']:.2f}"), ("decode tokens/s", f"{decode_tps:.1f}"),
            ("wall s (incl. compile)", f"{wall:.2f}"),
            ("KV bytes read / token", f"{out.stats['kv_bytes_read'] / max(out.stats['decode_steps'], 1):,.0f}")]
    for k, v in rows:
        print(f"{k:<28}{v}")
    return {"text": text, "tokens": out.tokens, "stats": out.stats, "seconds": out.seconds,
            "decode_tokens_per_s": decode_tps, "model": desc}


def _engine_for(cfg, longest: int, model):
    ecfg = build(EngineConfig, cfg.engine)
    if ecfg.max_seq_len < longest:
        print(f"engine.max_seq_len raised from {ecfg.max_seq_len} to {longest} to fit the experiment")
        data = OmegaConf.to_container(cfg.engine, resolve=True)
        data["max_seq_len"] = longest
        ecfg = build(EngineConfig, data)
    return emulate_hardware(cfg, ecfg, model)[0]


def model_preset(name: str) -> ModelConfig:
    """A conf/model preset by name, as a ModelConfig."""
    path = os.path.join(ROOT, "conf", "model", f"{name}.yaml")
    if not os.path.exists(path):
        choices = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", "model")) if f.endswith(".yaml"))
        raise gj.errors.ConfigError(f"hardware reference_model={name!r} is not a model preset; one of {choices}.")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    data.pop("defaults", None)
    return build(ModelConfig, data)


def emulate_hardware(cfg, ecfg: EngineConfig, model):
    """(engine config, record): on a machine without the selected hardware tier, the tiers are
    sized to that tier's device / host / disk split of its reference workload's KV
    (gemini_jax.tiers.emulate); the record says what was set (None when nothing was)."""
    hw = build(HardwareConfig, cfg.hardware)
    if hw.present or not hw.reference_model:
        return ecfg, None
    from gemini_jax.tiers.emulate import cap_engine, proportions

    p = proportions(hw, model_preset(hw.reference_model), hw.reference_context, name=hw.reference_model)
    disk = ecfg.tier.disk_path
    if disk is None:
        try:
            disk = os.path.join(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir, "kv_disk")
        except ValueError:  # not under Hydra (a test calling the function directly)
            import tempfile

            disk = tempfile.mkdtemp(prefix="gj_emulated_disk_")
    ecfg, rec = cap_engine(ecfg, p, num_layers=model.cfg.num_layers, disk_path=disk)
    raised = (f" (raised from {rec['raised_from']:.2%}: one call's pages must fit)"
              if rec["raised_from"] is not None else "")
    if rec["prefill_chunk_from"] is not None:
        raised += f"; prefill_chunk lowered from {rec['prefill_chunk_from']} to {rec['prefill_chunk']}"
    print(f"EMULATED hardware {p.describe()}. This run: device {rec['device_fraction']:.2%} of its pages{raised}, "
          f"host {'unbounded' if rec['host_pages'] is None else str(rec['host_pages']) + ' (layer, page) units'}, "
          f"disk {rec['disk_path'] or '-'}. Times below are this machine's; the tier's are projections.")
    return ecfg, rec


def _haystack(name: str):
    from gemini_jax.data import corpus

    if name in ("heldout", "train"):
        return corpus.load_split(name)[1]
    with open(name, "rb") as fh:
        return np.frombuffer(fh.read(), np.uint8)


def run_needle(cfg, model, tok, desc):
    from gemini_jax.eval import needle, write_needle
    from gemini_jax.eval.journal import CellJournal
    from gemini_jax.eval.needle import NeedlePrompts

    ex = cfg.experiment
    lengths = [int(x) for x in ex.lengths]
    eng = gj.Engine(model, _engine_for(cfg, max(lengths) + 16, model))
    draw = Draw(str(ex.split), int(cfg.seed))
    chat = tok if hasattr(tok, "apply_chat_template") else None  # a chat model: plain-English prompts
    out_dir = os.path.join(results_root(cfg), "needle")
    # Each finished (length, depth) cell is kept beside the record: a rerun of the same job continues.
    settings = {k: v for k, v in OmegaConf.to_container(ex, resolve=True).items() if k != "resume"}
    journal = CellJournal(os.path.join(out_dir, f"{ex.out_name}.partial.jsonl"),
                          {"experiment": settings, "engine": OmegaConf.to_container(cfg.engine, resolve=True),
                           "model": desc, "seed": int(cfg.seed)}, resume=bool(ex.get("resume", True)))
    if journal.resumed:
        print(f"resuming {ex.out_name}: {journal.resumed} cell(s) measured by an earlier run ({journal.path})")
    res = needle(eng, lengths, [float(d) for d in ex.depths], trials=int(ex.trials), batch=int(ex.batch),
                 prompts=NeedlePrompts(distractors=int(ex.distractors), tokenizer=chat),
                 haystack=_haystack(ex.haystack), draw=draw, journal=journal)
    e = eng.config
    label = (f"{desc}; cache {e.cache.kind} bs={e.cache.block_size}"
             + (f" {e.cache.dtype}" if e.cache.dtype else "") + "; "
             + (f"sparse {e.sparse.digest} budget={e.sparse.budget}"
                + (", sparse prefill" if e.sparse.sparse_prefill else "")
                + (", compact positions" if e.sparse.positions == "compact" else "")
                + (f", scored at distance {e.sparse.score_distance}" if e.sparse.score_distance else "")
                + (f", rerank {e.sparse.rerank}" if e.sparse.rerank else "") if e.sparse.enabled else "dense"))
    meta = provenance(command=job_command(), config=OmegaConf.to_container(ex, resolve=True), split=draw.split,
                      seeds=[draw.seed])
    if journal.resumed:
        label += f"; {journal.resumed} cell(s) from an interrupted run, commits {sorted(journal.commits())}"
    paths = write_needle(res, out_dir, ex.out_name, f"{label}; {draw.split} trials",
                         {"study": "needle", "name": ex.out_name, **meta, "haystack": str(ex.haystack),
                          "engine": OmegaConf.to_container(cfg.engine), "model": desc,
                          "journal": {"resumed_cells": journal.resumed, "cell_commits": journal.commits()}})
    journal.close()
    print(f"model: {desc}")
    for L, accs, r in zip(res.lengths, res.accuracy, res.by_length()):
        print(f"{L:>8}  " + "  ".join(f"{a:.2f}" for a in accs)
              + f"   {r['hits']}/{r['trials']} [{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}]%")
    print(f"{'overall accuracy':<28}{res.overall:.3f}")
    print(f"{'written':<28}{paths['md']}")
    return {"stats": dict(eng.stats), **res.to_dict()}


def run_perplexity(cfg, model, tok, desc):
    from gemini_jax.eval import perplexity, unigram_bits_per_byte

    ex = cfg.experiment
    contexts = [int(c) for c in ex.contexts]
    eng = gj.Engine(model, _engine_for(cfg, max(contexts) + 16, model))
    draw = Draw(str(ex.split), int(cfg.seed))
    rows = [perplexity(eng, c, windows=int(ex.windows), scored=int(ex.scored), draw=draw, tokenizer=tok)
            for c in contexts]
    unit = rows[0]["unit"] if rows else "byte"  # byte: the byte model; token: another tokenizer's windows
    uni = unigram_bits_per_byte()
    print(f"model: {desc}")
    for r in rows:
        print(f"{'bits/byte @' + str(r['context']):<28}{r['bits_per_byte']:.3f} "
              f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] ({r['windows']} x {r['scored_per_window']} {unit}s)")
    print(f"{'unigram baseline':<28}{uni:.3f}")
    result = make_record("perplexity", StudyResult(
        name=ex.out_name, records=rows, split=draw.split, seeds=[draw.seed],
        extra={"unigram_bits_per_byte": uni, "model": desc, "engine": OmegaConf.to_container(cfg.engine)}),
        command=job_command(), config=OmegaConf.to_container(ex, resolve=True))
    md = (f"### bits per byte, held-out stdlib ({desc}; {draw.split} windows)\n\n"
          f"{int(ex.windows)} windows x {int(ex.scored)} scored {unit}s per context (context in {unit}s"
          + ("" if unit == "byte" else "; bits over the UTF-8 bytes the scored tokens decode to")
          + "); 95% t interval over windows.\n\n"
          "| context | bits/byte | 95% interval |\n|---|---|---|\n"
          + "".join(f"| {r['context']} | {r['bits_per_byte']:.3f} | [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] |\n"
                    for r in rows)
          + f"| unigram baseline | {uni:.3f} | |\n")
    write_record(results_root(cfg), result, md)
    return {"stats": dict(eng.stats), **result}


def run_ruler(cfg, model, tok, desc):
    from gemini_jax.eval.ruler import RulerPrompts, ruler

    ex = cfg.experiment
    lengths = [int(x) for x in ex.lengths]
    eng = gj.Engine(model, _engine_for(cfg, max(lengths) + 128, model))  # + the longest answer
    draw = Draw(str(ex.split), int(cfg.seed))
    hay = _haystack(ex.haystack)
    results, reads = [], {}
    for t in ex.tasks:
        before = dict(eng.stats)
        chat = tok if hasattr(tok, "apply_chat_template") else None  # a chat model: tasks asked through its template
        results.append(ruler(eng, str(t), lengths, trials=int(ex.trials), haystack=hay, draw=draw,
                             batch=int(ex.batch), prompts=RulerPrompts(str(ex.kind), chat)))
        # KV (and digest) bytes one sequence read per generated token, over the task's lengths.
        steps = max(eng.stats["decode_steps"] - before["decode_steps"], 1) * int(ex.batch)
        reads[str(t)] = {k: (eng.stats[k] - before[k]) / steps for k in ("kv_bytes_read", "digest_bytes_read")}
    rows = [{"task": r.task, **row} for r in results for row in r.by_length()]
    result = make_record("ruler", StudyResult(
        name=ex.out_name, records=[{"task": r.task, **x} for r in results for x in r.records],
        split=draw.split, seeds=[draw.seed],
        extra={"by_task_length": rows, "bytes_per_token": reads, "model": desc, "engine": OmegaConf.to_container(cfg.engine)}),
        command=job_command(), config=OmegaConf.to_container(ex, resolve=True))
    md = (f"### RULER-style tasks ({desc}; {draw.split} trials, {ex.kind} keys)\n\n"
          "Exact match with its 95% Wilson interval; recall: the share of expected answers named.\n\n"
          "| task | length | exact | 95% interval | recall |\n|---|---|---|---|---|\n"
          + "".join(f"| {r['task']} | {r['length']} | {r['hits']}/{r['trials']} | "
                    f"[{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}]% | {r['recall']:.2f} |\n" for r in rows)
          + "\nKV bytes read per generated token (all layers, one sequence; digests beside): "
          + "; ".join(f"{t} {b['kv_bytes_read']:,.0f} (+{b['digest_bytes_read']:,.0f})" for t, b in reads.items())
          + ".\n")
    paths = write_record(results_root(cfg), result, md)
    print(md, end="")
    print(f"{'written':<28}{paths['md']}")
    return {"stats": dict(eng.stats), "by_task_length": rows}


def _needle_task(cfg, tok):
    """(example, tokens to generate for the answer, instruction tokens, instruction text, verdict):
    a chat model (a tokenizer with a chat template) gets the question in plain English through its
    template and the instruction as a new user turn; the byte model gets its own needle format."""
    from gemini_jax.data import tasks

    ex = cfg.experiment
    hay, rng = _haystack(ex.haystack), np.random.default_rng(cfg.seed)
    if hasattr(tok, "apply_chat_template"):
        from gemini_jax.data import chat

        example = chat.chat_needle_example(hay, tok, int(ex.length), float(ex.depth), rng)
        instr = str(ex.instruction)
        return example, int(ex.get("answer_tokens", 12)), chat.chat_continuation(tok, instr), instr, \
            chat.chat_answer_correct
    from gemini_jax.eval.needle import is_correct

    example = tasks.needle_example(hay, int(ex.length), float(ex.depth), rng)
    return example, tasks.KEY_DIGITS + 1, tok.encode(str(ex.instruction)), str(ex.instruction), is_correct


def run_fullstack(cfg, model, tok, desc):
    """Needle in a long context through paged + sparse + tiered; then interrupt, snapshot, resume.

    Three engines, each named in the table: A answers the question with `generate`; B streams the
    same prompt as a `Session`, is interrupted after `interrupt_after` tokens and snapshotted; C (a
    new engine, as a new process would be) resumes that snapshot with the instruction."""
    import shutil
    import tempfile

    ex = cfg.experiment
    example, answer_len, instr, instr_text, correct = _needle_task(cfg, tok)
    room = int(ex.interrupt_after) + 2 * answer_len + len(instr) + 16  # answers, interrupt, instruction
    ecfg = gj.config.replace(build(EngineConfig, cfg.engine), max_seq_len=len(example.prompt) + room)
    ecfg, emulated = emulate_hardware(cfg, ecfg, model)
    if ecfg.tier.enabled:  # a prefill chunk's pages must fit the device slots beside the pins
        S = ecfg.cache.block_size
        cap = max(S, ecfg.tier.device_slots(ecfg.num_pages) * S // 4)
        chunk = ecfg.prefill_chunk
        while chunk > cap:
            chunk //= 2
        if chunk != ecfg.prefill_chunk:
            print(f"engine.prefill_chunk lowered from {ecfg.prefill_chunk} to {chunk}: a chunk's pages must fit "
                  f"a quarter of the {ecfg.tier.device_slots(ecfg.num_pages)} device slots per layer")
            ecfg = gj.config.replace(ecfg, prefill_chunk=chunk)
    e = model.cfg
    print(f"model: {desc}")
    print(f"needle: pass key {example.answer} at token {example.needle_at:,} of {len(example.prompt):,} "
          f"(depth {float(ex.depth)})")

    # A. The question, through every layer of the cache.
    greedy = SamplingParams(max_new_tokens=answer_len, temperature=0.0)
    with gj.Engine(model, ecfg) as eng:
        t0 = time.perf_counter()
        out = eng.generate(example.prompt, greedy)
        wall = time.perf_counter() - t0
        tier = eng.tier_stats()
    answer = tok.decode(out.tokens)
    ok = correct(answer, example.answer)
    print(f"engine A answered {answer!r}: {'correct' if ok else 'WRONG'} (prefill {out.seconds['prefill']:.1f} s); "
          f"now engine B streams, is interrupted and snapshotted; engine C resumes ...", flush=True)
    st = out.stats
    steps = max(st["decode_steps"], 1)
    per_token_kv = 2 * e.num_layers * e.num_kv_heads * e.head_dim * np.dtype(e.dtype).itemsize
    dense_bytes = (len(example.prompt) + answer_len / 2) * per_token_kv  # a dense step reads every token's KV
    read = (st["kv_bytes_read"] + st["digest_bytes_read"]) / steps
    kv_total = len(example.prompt) * per_token_kv
    hits, misses = st["prefetch_hits"], st["prefetch_misses"]

    # B and C: interrupt, snapshot, resume, each engine with its own disk tier.
    def session_cfg(name):
        if not ecfg.tier.enabled or ecfg.tier.disk_path is None:
            return ecfg
        return gj.config.replace(ecfg, tier=gj.config.replace(ecfg.tier, disk_path=os.path.join(
            ecfg.tier.disk_path, name)))

    snap_dir = ex.snapshot_dir or tempfile.mkdtemp(prefix="gj_fullstack_")
    eng_b = eng_c = None
    try:
        eng_b = gj.Engine(model, session_cfg("session"))
        t0 = time.perf_counter()
        sess = eng_b.start(example.prompt, SamplingParams(max_new_tokens=int(ex.interrupt_after) + answer_len,
                                                          temperature=0.0))
        prefill_b = time.perf_counter() - t0
        first = []
        step_s = []  # decode steps after each session's first (which compiles its program)
        t0 = time.perf_counter()
        for t in sess:
            if first:
                step_s.append(time.perf_counter() - t0)
            first.append(t)
            if len(first) == int(ex.interrupt_after):
                sess.interrupt()
            t0 = time.perf_counter()
        path = os.path.join(snap_dir, "snap")
        sess.snapshot(path)
        sess.close()
        eng_b.close()
        eng_c = gj.Engine(model, session_cfg("resumed"))
        t0 = time.perf_counter()
        resumed = eng_c.resume(path, instr, params=greedy)
        resume_s = time.perf_counter() - t0
        after = []
        t0 = time.perf_counter()
        for t in resumed:
            if after:
                step_s.append(time.perf_counter() - t0)
            after.append(t)
            t0 = time.perf_counter()
        resumed.close()
    finally:
        for eng_ in (eng_b, eng_c):
            if eng_ is not None:
                eng_.close()
        if not ex.snapshot_dir:
            shutil.rmtree(snap_dir, ignore_errors=True)
    again = tok.decode(after)
    again_ok = correct(again, example.answer)
    rows = [("A: answer (generate)", f"{answer!r} (pass key {example.answer}): {'correct' if ok else 'WRONG'}"),
            ("A: prefill s", f"{out.seconds['prefill']:.1f} ({len(example.prompt):,} tokens, compile included)"),
            ("A: KV + digest bytes read / token", f"{read:,.0f} = {100 * read / dense_bytes:.1f}% of dense KV"),
            ("A: device-tier share of KV", f"{100 * tier['kv_bytes_device'] / kv_total:.1f}% "
                                           f"({tier['device_slots_per_layer']} slots / layer)" if tier
             else "100% (no tiers: every page on device)"),
            ("A: prefetch hit rate", f"{100 * hits / (hits + misses):.1f}% ({hits}/{hits + misses})" if hits + misses
             else "- (no page left the device)"),
            ("A: wall s (incl. compile)", f"{wall:.1f}"),
            ("B: prefill s (session)", f"{prefill_b:.1f} (the same prompt, a second engine)"),
            ("B: interrupted after", f"{tok.decode(first)!r} ({len(first)} tokens), snapshot written"),
            ("C: resume instruction", repr(instr_text)),
            ("C: answer after resume", f"{again!r}: {'correct' if again_ok else 'wrong'}"),
            ("C: resume s vs B's prefill s", f"{resume_s:.2f} vs {prefill_b:.1f} "
                                             f"({prefill_b / max(resume_s, 1e-9):.0f}x faster than prefilling again)"),
            ("B+C: decode tokens/s", f"{len(step_s) / max(sum(step_s), 1e-9):.1f} (median step "
                                     f"{1e3 * np.median(step_s) if step_s else float('nan'):.0f} ms over "
                                     f"{len(step_s)} compiled steps)")]
    if emulated:
        rows.insert(4, (f"EMULATED {emulated['hardware']} split", (
            f"device {emulated['tier_device_fraction']:.1%} / host {emulated['tier_host_fraction']:.1%} / disk "
            f"{emulated['tier_disk_fraction']:.1%} of {emulated['reference']} @ {emulated['context']:,} tokens")))
    # The counted transfers projected onto the selected hardware tier (a projection, not a run there).
    from gemini_jax.tiers.cost_model import RunCounters, project

    hw = build(HardwareConfig, cfg.hardware)
    page_bytes = 2 * e.num_kv_heads * ecfg.cache.block_size * e.head_dim * np.dtype(e.dtype).itemsize
    try:
        proj = project(RunCounters.from_stats(st, page_bytes=page_bytes), hw)
        rows.append((f"PROJECTED attention step on {hw.name}",
                     f"{1e3 * proj['projected_step_seconds']:.3f} ms (cost model from counted transfers; "
                     f"a projection, not a measurement)"))
    except gj.errors.ConfigError as err:
        proj = {"label": "projection", "hardware": hw.name, "error": str(err)}
        rows.append((f"projection on {hw.name}", "- (this tier's figures are measured, not nominal: pick "
                                                 "hardware=rtx4090 / a100_80g / h200 ... to project)"))
    print("-" * 72)
    for k, v in rows:
        print(f"{k:<36}{v}")
    result = {"answer": answer, "correct": ok, "key": example.answer, "length": len(example.prompt), "stats": st,
              "tier": tier, "emulated": emulated, "projection": proj, "resume_seconds": resume_s,
              "prefill_seconds_session": prefill_b, "after_resume": again, "after_resume_correct": again_ok,
              "interrupted_after": tok.decode(first), "instruction": instr_text,
              "decode_step_seconds": step_s, "kv_read_fraction_of_dense": read / dense_bytes, "model": desc}
    # The job's figures as a record (command, commit, seed).
    record = make_record("fullstack", StudyResult(
        name=str(ex.out_name), records=[{k: v for k, v in result.items() if k not in ("stats", "tier", "projection")}],
        # one needle drawn from the seed: a dev trial (the job's defaults were chosen watching it)
        split="dev", seeds=[int(cfg.seed)],
        extra={"haystack": str(ex.haystack), "stats": dict(st), "tier": tier, "table": dict(rows)}),
        command=job_command(), config=OmegaConf.to_container(cfg, resolve=True))
    paths = write_record(results_root(cfg), record,
                         "\n".join([f"# The main job ({desc})", "", f"`{record['command']}` at commit {record['commit']}, "
                                    f"seed {cfg.seed}.", "", "| | |", "| --- | --- |",
                                    *[f"| {k} | {v} |" for k, v in rows]]))
    print(f"{'record':<36}{paths['md']} (table) and {os.path.basename(paths['json'])} (figures)")
    return result


def results_root(cfg) -> str:
    """Where this job's records go: `results_dir` (relative to the checkout) when set, else the job's
    own output directory (Hydra's, git-ignored), so a plain run leaves the tracked tree untouched."""
    if cfg.get("results_dir"):
        return os.path.join(ROOT, cfg.results_dir)
    try:
        return hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    except ValueError:  # not under Hydra (a test calling a job function directly)
        raise gj.errors.ConfigError("results_dir is unset and there is no Hydra output directory: "
                                    "pass results_dir=<a directory>.") from None


def job_command() -> str:
    """The command line that reproduces this job: the script and its Hydra overrides."""
    try:
        overrides = list(hydra.core.hydra_config.HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (a test calling a job function directly)
        overrides = ["(called directly, not under Hydra)"]
    return " ".join(["python experiments/run.py", *overrides])


def run_study(cfg) -> dict:
    """A study from gemini_jax.eval.studies: its Config from the experiment node, its workload, and
    its record written to <results_dir>/<study>/<name>.json + .md (gemini_jax.eval.record)."""
    import dataclasses

    name = cfg.experiment.name
    study = studies.load(name)
    data = OmegaConf.to_container(cfg.experiment, resolve=True)
    data.pop("name")
    scfg = build(study.Config, data)
    res = study.run(scfg)
    config = json.loads(json.dumps(dataclasses.asdict(scfg)))  # tuples as lists, as the JSON will hold them
    record = make_record(name, res, command=job_command(), config=config)
    md = study.markdown(record)
    paths = write_record(results_root(cfg), record, md)
    print(md, end="")
    print(f"wrote {paths['json']} and .md")
    return {"stats": {}, "record": paths}


EXPERIMENTS = {"generate": run_generate, "needle": run_needle, "perplexity": run_perplexity,
               "fullstack": run_fullstack, "ruler": run_ruler}


@hydra.main(version_base=None, config_path="../conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("WANDB_MODE", cfg.wandb.mode)
    # Library logs stay out of the job's story unless asked for (log_level=INFO shows Orbax's
    # save / restore trace); wandb prints nothing but errors (WANDB_SILENT=false to see it).
    logging.getLogger("absl").setLevel(cfg.get("log_level", "WARNING"))
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    if cfg.get("distributed", False):
        from gemini_jax.distributed import initialize_from_env

        joined = initialize_from_env()
        print(f"jax.distributed: {'joined a multi-host job' if joined else 'single process (no coordinator in env)'}; "
              f"{jax.process_count()} process(es), {jax.device_count()} device(s)")
    hw = build(HardwareConfig, cfg.hardware)
    build(EngineConfig, cfg.engine)  # a wrong engine field fails here, before a model loads for seconds
    name = cfg.experiment.name
    if name not in EXPERIMENTS and name not in studies.NAMES:
        raise gj.errors.ConfigError(f"experiment.name={name!r} must be one of {sorted([*EXPERIMENTS, *studies.NAMES])}.")
    loaded = load_model(cfg) if name in EXPERIMENTS else None  # a study loads its own model
    wandb_dir = os.path.join(ROOT, cfg.wandb.dir)
    os.makedirs(wandb_dir, exist_ok=True)
    run = wandb.init(project=cfg.wandb.project, dir=wandb_dir, mode=cfg.wandb.mode, job_type=name,
                     config=OmegaConf.to_container(cfg, resolve=True))
    result = EXPERIMENTS[name](cfg, *loaded) if loaded else run_study(cfg)
    result["hardware"] = hw.name
    run.log({k: v for k, v in result["stats"].items()})
    run.finish()
    out_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    with open(os.path.join(out_dir, "result.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o))
    print(f"{'wandb run':<28}{run.dir if hasattr(run, 'dir') else wandb_dir}")
    print(f"{'result file':<28}{os.path.join(out_dir, 'result.json')}")


if __name__ == "__main__":
    main()
