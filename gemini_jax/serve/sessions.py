"""Interruptible decoding over the network: the server's requests by id, what an interrupt keeps,
snapshots on request, resumed turns, and the hash-chained audit log of every turn.

An interrupted request keeps its pages' image and the logits after its last token in memory;
`snapshot` writes them as an Orbax snapshot (the format `Engine.resume` reads); `turn` builds the
request that resumes it with an instruction (and an optional rewind). A resume is always audited
against a snapshot, written first if the client did not ask for one, so `python -m
gemini_jax.audit verify LOG --replay` can replay every turn through `Engine.resume`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from typing import Optional

from gemini_jax.config import SamplingParams
from gemini_jax.errors import SnapshotError
from gemini_jax.runtime.images import SequenceImage
from gemini_jax.serve.request import Request
from gemini_jax.session import audit, snapshot


@dataclasses.dataclass
class _Parked:
    """What `snapshot.save_snapshot` reads from a session, for an interrupted request."""

    engine: object
    logits: object  # f32[1, V]
    prompt_len: int
    generated: list
    new_tokens: int
    params: SamplingParams
    compute_units: int
    seq_id: Optional[int] = None
    finished: bool = False
    sample_index: int = 0
    budget: Optional[int] = None


@dataclasses.dataclass
class Turn:
    """A resumed turn, for its audit record once it ends."""

    snapshot: str
    snapshot_hash: str
    position: int
    rewind_to: Optional[int]
    instruction_tokens: list
    instruction_text: Optional[str]
    started: float


class Sessions:
    """Requests by id (running ones, and interrupted ones until deleted or `ttl_s` after their
    interrupt); their snapshots and the audit log under `state_dir` (`snapshots/<id>`, `audit.jsonl`).
    `clock`: seconds, monotonic (a test passes its own)."""

    def __init__(self, engine, state_dir: Optional[str], *, ttl_s: float = 0.0, clock=time.monotonic):
        self.engine = engine
        self.ttl_s, self._clock = float(ttl_s), clock
        self._parked: dict[str, float] = {}  # interrupted id -> when it parked
        self.expired: dict[str, Optional[str]] = {}  # dropped id -> its snapshot path (None: never taken)
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gemini_jax-serve-")
            state_dir = self._tmp.name
        self.state_dir = os.path.abspath(state_dir)
        self.audit_path = os.path.join(self.state_dir, "audit.jsonl")
        self.requests: dict[str, Request] = {}
        self.snapshots: dict[str, tuple[str, str]] = {}  # id -> (path, content hash)
        self._lock = threading.Lock()

    def add(self, sid: str, req: Request) -> None:
        with self._lock:
            self.requests[sid] = req
            self._parked.pop(sid, None)

    def get(self, sid: str) -> Optional[Request]:
        with self._lock:
            self._expire()
            return self.requests.get(sid)

    def ended(self, sid: str, req: Request) -> None:
        """A request ended: an interrupted one stays (resumable) until its time to live runs out,
        others are forgotten."""
        with self._lock:
            if req.finish_reason != "interrupted":
                self.requests.pop(sid, None)
            elif sid in self.requests:
                self._parked[sid] = self._clock()
            self._expire()

    def delete(self, sid: str) -> bool:
        with self._lock:
            self._parked.pop(sid, None)
            return self.requests.pop(sid, None) is not None

    @property
    def parked(self) -> int:
        """Interrupted requests held in memory."""
        with self._lock:
            self._expire()
            return len(self._parked)

    def _expire(self) -> None:
        """Drop interrupted requests parked longer than ttl_s (caller holds the lock). Their host
        copies of KV go; a snapshot taken on disk stays, and its path is remembered for the 404."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        for sid in [s for s, t in self._parked.items() if now - t > self.ttl_s]:
            del self._parked[sid]
            self.requests.pop(sid, None)
            self.expired[sid] = self.snapshots.get(sid, (None, None))[0]

    # ---- snapshots --------------------------------------------------------------------------------
    def snapshot(self, sid: str, req: Request) -> tuple[str, str]:
        """Write (once) the interrupted request's Orbax snapshot; (path, content hash)."""
        if sid in self.snapshots:
            return self.snapshots[sid]
        if req.finish_reason != "interrupted" or req.image is None:
            raise SnapshotError(f"session {sid} is not interrupted ({req.finish_reason or req.phase.value}); "
                                f"interrupt it first.")
        path = os.path.join(self.state_dir, "snapshots", sid)
        parked = _Parked(engine=self.engine, logits=req.logits[None], prompt_len=req.prompt_len,
                         generated=list(req.generated), new_tokens=req.new_tokens, params=req.params,
                         compute_units=req.compute_units, sample_index=req.sample_index)
        digest = snapshot.save_snapshot(parked, path, image=req.image)
        self.snapshots[sid] = (path, digest)
        return path, digest

    # ---- resumed turns ----------------------------------------------------------------------------
    def turn(self, sid: str, req: Request, instruction: list, rewind_to: Optional[int], params: SamplingParams,
             instruction_text: Optional[str]) -> tuple[Request, Turn]:
        """The request that resumes interrupted `req` (not submitted yet) and its audit turn.
        ValueError for a rewind outside [1, position]."""
        path, digest = self.snapshot(sid, req)
        image: SequenceImage = req.image
        position = len(image.tokens)
        keep = position if rewind_to is None else int(rewind_to)
        if not 1 <= keep <= position:
            raise ValueError(f"rewind_to={rewind_to} must be in [1, {position}] (the session holds {position} tokens).")
        tokens = list(image.tokens[:keep]) + [int(t) for t in instruction]
        new = Request("", tokens, params, priority=req.priority, tenant=req.tenant, sample_index=req.sample_index,
                      image=image, logits=req.logits, resume=(keep, rewind_to is not None))
        new.prompt_len = len(tokens)
        return new, Turn(snapshot=path, snapshot_hash=digest, position=position, rewind_to=rewind_to,
                         instruction_tokens=[int(t) for t in instruction], instruction_text=instruction_text,
                         started=time.time())

    def record(self, turn: Turn, req: Request) -> None:
        """Append the ended turn to the audit chain (called from the scheduler's thread)."""
        audit.AuditLog(self.audit_path).append(
            snapshot=turn.snapshot, snapshot_hash=turn.snapshot_hash, position=turn.position,
            rewind_to=turn.rewind_to, instruction_tokens=turn.instruction_tokens,
            instruction_text=turn.instruction_text, sampling=dataclasses.asdict(req.params),
            result_tokens=list(req.generated), result_sha256=audit.tokens_hash(req.generated),
            interrupted=req.finish_reason == "interrupted", started=turn.started, finished=time.time())

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
