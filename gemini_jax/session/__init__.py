"""Interruptible decoding: sessions, Orbax snapshots, resume with an instruction, audit, budget."""

from gemini_jax.session.audit import AuditLog, tokens_hash, verify
from gemini_jax.session.session import Session, restore_session
from gemini_jax.session.snapshot import fingerprint, load_snapshot

__all__ = ["AuditLog", "Session", "fingerprint", "load_snapshot", "restore_session", "tokens_hash", "verify"]
