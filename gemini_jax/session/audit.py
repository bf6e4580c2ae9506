"""Hash-chained audit log of interrupt/resume turns (append-only JSONL).

Each record holds the previous record's hash, the snapshot's content hash, the interrupt
position, the instruction, the resulting tokens' hash and timestamps; its own hash covers all
of it. `verify` walks the chain and names the first bad record; with an engine it also replays
each record (resume from the snapshot with the same instruction) and checks the result hash.

    python -m gemini_jax.audit verify LOG [--replay] [--weights HF_DIR]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

from gemini_jax.config import SamplingParams

GENESIS = "0" * 64


def tokens_hash(tokens) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()


def _record_hash(rec: dict) -> str:
    body = {k: v for k, v in rec.items() if k != "record_hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


class AuditLog:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    def append(self, **fields) -> dict:
        records = _read(self.path)
        prev = records[-1]["record_hash"] if records else GENESIS
        rec = {"index": len(records), "prev_hash": prev, **fields}
        rec["record_hash"] = _record_hash(rec)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return rec


def attach(sess, log_path: str, *, snapshot: str, snapshot_hash: str, position: int, rewind_to,
           instruction_tokens, instruction_text) -> None:
    """Record the turn when the session's iteration stops (end, EOS or interrupt)."""
    started = time.time()

    def on_stop(s):
        result = s.generated[-s.new_tokens:] if s.new_tokens else []
        AuditLog(log_path).append(
            snapshot=os.path.abspath(snapshot), snapshot_hash=snapshot_hash, position=position,
            rewind_to=rewind_to, instruction_tokens=[int(t) for t in instruction_tokens],
            instruction_text=instruction_text, sampling=dataclasses.asdict(s.params),
            result_tokens=[int(t) for t in result], result_sha256=tokens_hash(result),
            interrupted=s.interrupted, started=started, finished=time.time())

    sess.on_stop(on_stop)


def verify(path: str, engine=None) -> tuple[bool, str]:
    """(ok, message). Checks every record's hash and link; replays each with `engine` if given."""
    try:
        records = _read(path)
    except json.JSONDecodeError as e:
        return False, f"{path}: line {e.lineno} is not JSON"
    prev = GENESIS
    for i, rec in enumerate(records):
        if rec.get("index") != i or rec.get("prev_hash") != prev:
            return False, f"record {i}: broken chain (index or prev_hash does not link to record {i - 1})"
        if _record_hash(rec) != rec.get("record_hash"):
            return False, f"record {i}: content does not match its record_hash (tampered)"
        if tokens_hash(rec["result_tokens"]) != rec["result_sha256"]:
            return False, f"record {i}: result_tokens do not match result_sha256"
        prev = rec["record_hash"]
        if engine is not None and not rec.get("interrupted"):
            params = SamplingParams(**rec["sampling"]) if rec.get("sampling") else None
            sess = engine.resume(rec["snapshot"], rec["instruction_tokens"], rewind_to=rec["rewind_to"],
                                 params=params)
            if sess.snapshot_hash != rec["snapshot_hash"]:
                sess.close()
                return False, f"record {i}: snapshot {rec['snapshot']} changed since it was recorded"
            got = sess.run()
            sess.close()
            if tokens_hash(got) != rec["result_sha256"]:
                return False, f"record {i}: replay produced different tokens"
    return True, f"{len(records)} record(s) verified" + (" and replayed" if engine is not None else "")
