"""`/metrics` in the Prometheus text format: latency histograms observed as requests end, and
the scheduler's and engine's state read at scrape time (so a scrape equals `engine.stats`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gemini_jax.runtime import COUNTERS
from gemini_jax.serve.request import Request

# Seconds, from a loopback CPU server (tens of ms per token) up to minutes-long prefills.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, worker):
        self.worker = worker
        self.registry = CollectorRegistry()
        self.ttft = Histogram("gemini_jax_time_to_first_token_seconds", "Arrival to first token, per request",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("gemini_jax_time_per_output_token_seconds",
                              "Mean time between a request's tokens after the first", buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.requests = Counter("gemini_jax_requests", "Requests ended, by finish reason", ["reason"],
                                registry=self.registry)
        self.tenant_units = Counter("gemini_jax_tenant_compute_units", "Compute units used per tenant",
                                    ["tenant"], registry=self.registry)
        self.registry.register(_StateCollector(worker))

    def finished(self, req: Request) -> None:
        """Record a request that ended (called from the scheduler's thread)."""
        self.requests.labels(reason=req.finish_reason or "unknown").inc()
        self.tenant_units.labels(tenant=req.tenant or "default").inc(req.compute_units)
        if req.t_first is not None:
            self.ttft.observe(req.t_first - req.t_arrival)
            if req.new_tokens > 1:
                self.tpot.observe((req.t_last - req.t_first) / (req.new_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Read at each scrape, under the worker's lock (a step is never half-counted)."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self):
        sched = self.worker.scheduler
        with self.worker.lock:
            engine = sched.engine
            stats = dict(engine.stats)
            usage = engine.sequences.usage()
            tiers = engine.tier_stats()
            gauges = {
                "gemini_jax_queue_depth": ("Requests waiting to run", len(sched.waiting)),
                "gemini_jax_running_sequences": ("Requests holding pages (prefill or decode)", len(sched.live)),
                "gemini_jax_preempted_sequences": ("Requests waiting after a preemption", sched.preempted),
                "gemini_jax_pool_pages_used": ("Pages owned by live sequences", usage["pages_used"]),
                "gemini_jax_pool_pages_free": ("Pages free (some still caching a prefix)", usage["pages_free"]),
            }
            preemptions = sched.preemptions
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("gemini_jax_preemptions", "Requests preempted when pages ran out", value=preemptions)
        for name in COUNTERS:
            yield CounterMetricFamily(f"gemini_jax_engine_{name}", f"Engine counter {name} (engine.stats)",
                                      value=stats[name])
        hits, misses = stats["prefetch_hits"], stats["prefetch_misses"]
        if hits + misses:
            yield GaugeMetricFamily("gemini_jax_prefetch_hit_rate", "Prefetch hits / (hits + misses)",
                                    value=hits / (hits + misses))
        tier_pages = GaugeMetricFamily("gemini_jax_tier_value", "The tiers' counters (engine.tier_stats())",
                                       labels=["name"])
        for key, value in sorted(tiers.items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tier_pages.add_metric([key], value)
        yield tier_pages
