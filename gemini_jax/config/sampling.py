"""How the next token is picked (`SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick the next token. temperature == 0 means greedy (top_k/top_p ignored)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self):
        from gemini_jax.errors import SamplingError

        def req(cond, msg):
            if not cond:
                raise SamplingError(msg)

        req(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
            f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0.")
        req(self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        req(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k={self.top_k!r} must be an integer >= 0 (0 = off).")
        req(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1] (1 = off).")
