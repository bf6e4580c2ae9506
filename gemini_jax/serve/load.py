"""A load generator for the server: concurrent streaming completions over loopback HTTP, timed
at the client, summarised as throughput and latency percentiles.

    results = asyncio.run(run_streams(url, prompts, max_tokens=32, model="gemini-jax-tiny"))
    summary = summarize(results)

Tokens are counted as the UTF-8 bytes of each streamed piece: exact for the byte-level model we
ship (one token per byte), an approximation for other tokenizers (the final usage is kept too).
Bounded: every stream has a timeout, and the caller chooses how many run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class StreamResult:
    """One streamed completion as its client saw it (time.perf_counter seconds)."""

    t_sent: float
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    token_times: list = field(default_factory=list)  # one entry per token received
    completion_tokens: Optional[int] = None  # from the final usage chunk
    status: int = 200
    error: Optional[str] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.t_first is None else self.t_first - self.t_sent

    @property
    def tpot(self) -> Optional[float]:
        """Mean time between tokens after the first."""
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)


async def one_stream(client, url: str, body: dict, headers: dict, timeout: float) -> StreamResult:
    res = StreamResult(t_sent=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers,
                                 timeout=timeout) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")[:500]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    n = len(choice.get("text", "").encode("utf-8"))
                    if n and res.t_first is None:
                        res.t_first = now
                    res.token_times += [now] * n
    except Exception as e:  # noqa: BLE001 - a failed stream is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    res.t_end = time.perf_counter()
    return res


async def run_streams(url: str, prompts: list, *, max_tokens: int, model: str, api_key: Optional[str] = None,
                      timeout: float = 600.0, extra: Optional[dict] = None, client=None) -> list[StreamResult]:
    """Start one greedy streaming completion per prompt (token ids) at once; wait for all.
    `client`: an `httpx.AsyncClient` to send them on (kept open by the caller); by default one is
    made for this call. NOTE: making a client costs ~40 ms of CPU (it loads a TLS context), on the
    cores the server shares on loopback: a caller sending many small calls passes one client."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [{"model": model, "prompt": [int(t) for t in p], "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
              for p in prompts]
    if client is not None:
        return list(await asyncio.gather(*(one_stream(client, url, b, headers, timeout) for b in bodies)))
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as own:
        return list(await asyncio.gather(*(one_stream(own, url, b, headers, timeout) for b in bodies)))


def _pct(values, q) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[StreamResult]) -> dict:
    """Percentiles of TTFT and time per output token; output tokens/s over the whole run and
    while every stream decodes (from the last first token to the first stream's end)."""
    ok = [r for r in results if r.error is None and r.t_first is not None]
    out = {"streams": len(results), "failed": len(results) - len(ok),
           "ttft_p50": _pct([r.ttft for r in ok], 50), "ttft_p99": _pct([r.ttft for r in ok], 99),
           "tpot_p50": _pct([r.tpot for r in ok], 50), "tpot_p99": _pct([r.tpot for r in ok], 99),
           "output_tokens": sum(len(r.token_times) for r in ok)}
    if not ok:
        return {**out, "tokens_per_s": None, "decode_tokens_per_s": None, "all_decoding_seconds": 0.0}
    start, end = min(r.t_sent for r in ok), max(r.t_end for r in ok)
    out["tokens_per_s"] = out["output_tokens"] / (end - start)
    # The window where every stream has started and none has ended; tokens after each first one
    # (a first token closes its stream's prefill, so it belongs to the window's left edge).
    lo, hi = max(r.t_first for r in ok), min(r.token_times[-1] for r in ok)
    inside = sum(sum(1 for t in r.token_times if lo < t <= hi) for r in ok)
    out["all_decoding_seconds"] = max(0.0, hi - lo)
    out["decode_tokens_per_s"] = inside / (hi - lo) if hi > lo and inside else None
    return out


def percentile_ratio_ci(under: list, alone: list, q: float, *, resamples: int = 2000, seed: int = 0) -> dict:
    """The q-th percentile of `under` over that of `alone` (e.g. TTFTs under load and alone), with
    a 95% percentile-bootstrap interval: both samples resampled with replacement, independently,
    `resamples` times (seeded), the ratio of their percentiles each time. Also each sample's own
    percentile with its bootstrap interval."""
    a, b = np.asarray([v for v in under if v is not None], float), np.asarray([v for v in alone if v is not None], float)
    if not len(a) or not len(b):
        return {"q": q, "ratio": None, "ci95": None, "n_under": len(a), "n_alone": len(b)}
    rng = np.random.default_rng(seed)
    pa = np.percentile(a[rng.integers(0, len(a), (resamples, len(a)))], q, axis=1)
    pb = np.percentile(b[rng.integers(0, len(b), (resamples, len(b)))], q, axis=1)
    ci = lambda x: [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))]  # noqa: E731
    return {"q": q, "ratio": float(np.percentile(a, q) / np.percentile(b, q)), "ci95": ci(pa / pb),
            "under": float(np.percentile(a, q)), "under_ci95": ci(pa), "alone": float(np.percentile(b, q)),
            "alone_ci95": ci(pb), "n_under": len(a), "n_alone": len(b), "resamples": resamples, "seed": seed}
