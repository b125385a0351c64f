"""Prometheus metrics of one app (vLLM's names where the meaning is the same) on a private registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from segkv.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def speculative_stats(config: Any, counters: Any) -> dict | None:
    """Speculative decoding's settings (``config.describe()``) and verify-window counters (a
    generator's ``SpecStats``) for /metrics and the dashboard; None when speculation is off.

    ``acceptance_rate`` is accepted / draft tokens and ``mean_accepted_length`` the tokens per
    window (accepted drafts plus the one drawn after them), None before the first window.
    """
    if config is None:
        return None
    # read in the reverse order of SpecStats.record's writes, without the engine's lock: each
    # count is read no later than the ones that bound it, so accepted <= draft tokens holds
    per_position = list(counters.accepted_per_position)
    accepted = counters.accepted_tokens
    draft_tokens = counters.draft_tokens
    drafts = counters.drafts
    return {**config.describe(), "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_position,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def _tier_metrics(tiers: dict | None, model: str):
    """The KV tiers' gauges and counters per tier (nothing when the engine has none)."""
    if not tiers:
        return
    families = (
        (GaugeMetricFamily, "segkv:kv_tier_bytes", "Bytes of segment copies in each KV tier.", "{}_bytes"),
        (GaugeMetricFamily, "segkv:kv_tier_segments", "Segment copies in each KV tier.", "{}_segments"),
        (CounterMetricFamily, "segkv:kv_tier_hits", "Segments brought back from each KV tier.", "{}_hits"),
    )
    for kind, name, doc, key in families:
        family = kind(name, doc, labels=["model_name", "tier"])
        for tier in ("host", "disk"):
            family.add_metric([model, tier], tiers.get(key.format(tier), 0))
        yield family
    moved = CounterMetricFamily("segkv:kv_tier_bytes_moved", "Bytes copied between the KV tiers.",
                                labels=["model_name", "direction"])
    took = CounterMetricFamily("segkv:kv_tier_transfer_seconds", "Seconds the copies between the KV tiers took "
                               "(bytes_moved over it: the transfer rate).", labels=["model_name", "direction"])
    for direction in ("to_host", "from_host", "to_disk", "from_disk"):
        moved.add_metric([model, direction], tiers.get(f"bytes_{direction}", 0))
        took.add_metric([model, direction], tiers.get(f"seconds_{direction}", 0.0))
    yield moved
    yield took
    for name, doc, key in (("segkv:kv_tier_misses", "Segments asked of the KV tiers that no tier held.", "misses"),
                           ("segkv:kv_tier_corrupt", "Segment copies dropped by their checksum check.", "corrupt"),
                           ("segkv:kv_tier_recomputed_rows", "KV rows recomputed for lost tier copies.",
                            "recomputed_rows")):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], tiers.get(key, 0))
        yield family


class _EngineCollector(Collector):
    """Gauges and engine-side counters read from ``engine.stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self):
        stats = self._stats()
        prefix = stats.get("prefix", {})
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric([self._model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=label)
            family.add_metric([self._model], value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.",
                    stats["pages_in_use"] / max(stats["num_pages"], 1))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      prefix.get("num_query_tokens", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      prefix.get("num_hit_tokens", 0))
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of KV pages.",
                      stats["preemptions"])
        yield counter("segkv:bytes_copied", "KV-cache bytes copied (copy-on-write and compaction).",
                      stats.get("bytes_copied", 0))
        yield gauge("segkv:pages_in_use", "KV pages referenced by sequences or the prefix cache.",
                    stats["pages_in_use"])
        sessions = stats.get("sessions", {})
        yield counter("segkv:forks", "Session forks (no pages allocated).", sessions.get("forks", 0))
        yield counter("segkv:restores", "Session restores (no pages allocated).", sessions.get("restores", 0))
        yield gauge("segkv:shared_segments", "Cached segments also held by a running sequence or session.",
                    prefix.get("num_shared_nodes", 0))
        yield gauge("segkv:cached_segments", "Sealed segments in the prefix cache.", prefix.get("num_nodes", 0))
        ahead = CounterMetricFamily("segkv:decode_steps_ahead",
                                    "Decode steps launched before the host read the previous step's tokens: "
                                    "used, or cancelled (no work item of the next step took its rows).",
                                    labels=["model_name", "outcome"])
        for outcome, count in sorted(stats.get("steps_ahead", {}).items()):
            ahead.add_metric([self._model, outcome], count)
        yield ahead
        yield from _tier_metrics(stats.get("kv_tiers"), self._model)
        routes = CounterMetricFamily("segkv:route_steps", "Forward steps per attention route.",
                                     labels=["route"])
        for route, count in sorted(stats.get("routes", {}).items()):
            routes.add_metric([route], count)
        yield routes
        grammars = stats.get("grammar_cache", {})
        yield counter("segkv_grammar_cache_hits", "Constrained requests' grammars found compiled in the cache.",
                      grammars.get("hits", 0))
        yield counter("segkv_grammar_cache_misses", "Grammars compiled for constrained requests (cache misses).",
                      grammars.get("misses", 0))
        spec = stats.get("speculative")
        if spec is not None:  # as vLLM: the spec-decode counters exist only when speculation is on
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts (verify windows).",
                          spec["num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          spec["num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          spec["num_accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.",
                                          labels=["model_name", "position"])
            for position, count in enumerate(spec["num_accepted_tokens_per_pos"]):
                per_pos.add_metric([self._model, str(position)], count)
            yield per_pos


class ServerMetrics:
    """Request latency histograms and token counters, plus the engine's state at scrape time."""

    def __init__(self, stats: Callable[[], dict], *, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets) -> Histogram:
            made = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return made.labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.",
                              TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish of a request.",
                             E2E_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens of finished requests.")
        self.registry.register(_EngineCollector(stats, model_name))

    def observe_finished(self, output: RequestOutput, *, arrival: float, first_token_time: float | None,
                         now: float) -> None:
        """Record one finished engine request (all its ``n`` samples); times are monotonic seconds."""
        generated = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated)
        self.e2e.observe(max(now - arrival, 0.0))
        if first_token_time is None:
            return
        self.ttft.observe(max(first_token_time - arrival, 0.0))
        per_sample = generated / max(len(output.outputs), 1)
        if per_sample > 1:
            self.tpot.observe(max(now - first_token_time, 0.0) / (per_sample - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
