"""``/metrics`` in Prometheus's text format, through ``prometheus-client``.

Head-side figures are observed as they happen (requests, time to first token,
time between tokens, tokens generated: the engine is given a ``Metrics`` as its
observer); the engine's gauges and the stage figures (busy seconds, queue
depth, KV-cache bytes, weights, state) are handed to ``render`` at scrape
time, from the engine and every stage's Health. Each app has a registry of its
own.

That is an operator's view: every key's activity. A key that is not an
operator's (``keys.KeyPolicy``) sees its own: each key has a ``KeyMeter``, a
registry of the same names (its HTTP requests, tokens generated, prompt tokens
cached, live requests) counted for its requests alone.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxpipe.server.core.budget import STAGE_PARTS

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Stages:
    """Collects the stages' figures from the last Health snapshot."""

    def __init__(self):
        self.snapshot: List[Tuple[int, str, Optional[Any]]] = []  # (stage, address, its HealthReply)

    def collect(self):
        busy = CounterMetricFamily("mlxpipe_stage_busy_seconds", "Seconds each stage spent computing frames",
                                   labels=["stage", "address"])
        frames = CounterMetricFamily("mlxpipe_stage_frames", "Frames each stage computed", labels=["stage", "address"])
        queue = GaugeMetricFamily("mlxpipe_stage_queue_depth", "Frames waiting at each stage",
                                  labels=["stage", "address"])
        kv = GaugeMetricFamily("mlxpipe_stage_kv_cache_bytes", "KV-cache bytes each stage holds",
                               labels=["stage", "address"])
        weights = GaugeMetricFamily("mlxpipe_stage_weight_bytes", "Weight bytes each stage holds",
                                    labels=["stage", "address"])
        up = GaugeMetricFamily("mlxpipe_stage_up", "1 when the stage answers and is ready", labels=["stage", "address"])
        prefix = GaugeMetricFamily("mlxpipe_stage_prefix_cache_bytes", "Bytes of cached prefix blocks each stage holds",
                                   labels=["stage", "address"])
        reused = CounterMetricFamily("mlxpipe_stage_prompt_tokens_reused",
                                     "Prompt positions each stage took from its prefix cache", labels=["stage", "address"])
        computed = CounterMetricFamily("mlxpipe_stage_prompt_tokens_computed",
                                       "Prompt positions each stage computed", labels=["stage", "address"])
        disk = GaugeMetricFamily("mlxpipe_stage_prefix_disk_bytes", "Bytes of prefix blocks in each stage's disk tier",
                                 labels=["stage", "address"])
        disk_limit = GaugeMetricFamily("mlxpipe_stage_prefix_disk_limit_bytes",
                                       "Bytes each stage's disk tier may hold (0: none)", labels=["stage", "address"])
        disk_io = CounterMetricFamily("mlxpipe_stage_prefix_disk_blocks", "Prefix blocks each stage's disk tier "
                                      "read back, wrote, and dropped (missing or corrupt files)",
                                      labels=["stage", "address", "op"])
        for i, address, reply in self.snapshot:
            labels = [str(i), address]
            up.add_metric(labels, 1.0 if reply is not None and reply.state == "ready" else 0.0)
            if reply is None:
                continue
            busy.add_metric(labels, reply.stats.busy_seconds)
            frames.add_metric(labels, reply.stats.frames)
            queue.add_metric(labels, reply.stats.queue_depth)
            kv.add_metric(labels, reply.cache_bytes)
            weights.add_metric(labels, reply.weight_bytes)
            prefix.add_metric(labels, reply.prefix_bytes)
            reused.add_metric(labels, reply.stats.reused_tokens)
            computed.add_metric(labels, reply.stats.prefilled_tokens)
            disk.add_metric(labels, reply.prefix_disk_bytes)
            disk_limit.add_metric(labels, reply.prefix_disk_limit)
            for op, n in (("read", reply.stats.disk_blocks_read), ("written", reply.stats.disk_blocks_written),
                          ("dropped", reply.stats.disk_blocks_dropped)):
                disk_io.add_metric([*labels, op], n)
        yield from (busy, frames, queue, kv, weights, up, prefix, reused, computed, disk, disk_limit, disk_io)


class _Groups:
    """Each tensor-parallel group's ranks and what its all-reduces cost, from the last Health snapshot."""

    def __init__(self):
        self.snapshot: list = []  # (stage, its Placement, its HealthReply)

    def collect(self):
        ranks = GaugeMetricFamily("mlxpipe_group_rank_up", "1 for each rank of a stage's tensor-parallel group that "
                                  "answers and is ready", labels=["stage", "rank", "address"])
        per_token = GaugeMetricFamily("mlxpipe_group_allreduce_seconds_per_token", "What a token's all-reduces cost "
                                      "each group (one timed at load, times those a token needs)", labels=["stage"])
        handoff = CounterMetricFamily("mlxpipe_group_handoff_seconds", "Seconds each group's leader spent handing "
                                      "work items to its other ranks", labels=["stage"])
        for i, st, reply in self.snapshot:
            if reply is None or not reply.group_size:
                continue
            ranks.add_metric([str(i), "0", st.address], 1.0 if reply.state == "ready" else 0.0)
            for r, (address, rh, _) in enumerate(getattr(st, "rank_health", ()), start=1):
                ranks.add_metric([str(i), str(r), address], 1.0 if rh is not None and rh.state == "ready" else 0.0)
            per_token.add_metric([str(i)], reply.allreduce_seconds * reply.allreduces_per_token)
            handoff.add_metric([str(i)], reply.stats.mirror_seconds)
        yield from (ranks, per_token, handoff)


class _Budget:
    """The head's totals of where frames' time went (``core/budget.KindTotals`` per kind), at scrape time."""

    def __init__(self):
        self.kinds: dict = {}

    def collect(self):
        labels = ["kind", "part"]
        seconds = CounterMetricFamily(
            "mlxpipe_frame_seconds", "Seconds timed frames took, by part: queued, decode, compute, encode (summed "
            "over the stages), wire (the round trip less those), head (handling the result), round_trip", labels=labels)
        per_stage = CounterMetricFamily("mlxpipe_stage_frame_seconds", "Seconds timed frames took on each stage",
                                        labels=["kind", "stage", "part"])
        frames = CounterMetricFamily("mlxpipe_frames_timed", "Frames timed, by kind", labels=["kind"])
        tokens = CounterMetricFamily("mlxpipe_frame_tokens_timed", "Positions the timed frames carried", labels=["kind"])
        for kind, t in self.kinds.items():
            for part in STAGE_PARTS:
                seconds.add_metric([kind, part], t.part(part))
            for part in ("wire", "head", "round_trip"):
                seconds.add_metric([kind, part], getattr(t, part))
            for i, parts in enumerate(t.stages):
                for part, value in zip(STAGE_PARTS, parts):
                    per_stage.add_metric([kind, str(i), part], value)
            frames.add_metric([kind], t.frames)
            tokens.add_metric([kind], t.tokens)
        yield from (seconds, per_stage, frames, tokens)


class _Links:
    """Every link's latency and throughput (``cluster/links.py``), at scrape time."""

    def __init__(self):
        self.links: list = []  # Link.to_dict()s

    def collect(self):
        labels = ["link", "source", "target"]
        latency = GaugeMetricFamily("mlxpipe_link_latency_seconds", "One-way latency of each link", labels=labels)
        rate = GaugeMetricFamily("mlxpipe_link_bytes_per_second", "Throughput of each link (0: not measured)",
                                 labels=labels)
        for link in self.links:
            key = [link["name"], link["source"], link["target"]]
            latency.add_metric(key, link["latency_s"])
            rate.add_metric(key, link["bytes_per_s"])
        yield from (latency, rate)


class _Embeddings:
    """What the head's embedding model embedded (``cluster/embedding_model.py``), at scrape time."""

    def __init__(self):
        self.model = None  # the head's EmbeddingModel, if any

    def collect(self):
        inputs = CounterMetricFamily("mlxpipe_embedding_inputs", "Inputs the embedding model embedded")
        tokens = CounterMetricFamily("mlxpipe_embedding_tokens", "Tokens of the inputs the embedding model embedded")
        if self.model is not None:
            inputs.add_metric([], self.model.inputs)
            tokens.add_metric([], self.model.tokens)
            yield from (inputs, tokens)


class KeyMeter:
    """One key's own activity, under the names an operator's view gives everyone's."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxpipe_http_requests", "This key's HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.tokens = Counter("mlxpipe_generated_tokens", "Tokens generated for this key", registry=r)
        self.cached = Counter("mlxpipe_prompt_tokens_cached", "This key's prompt tokens served from the prefix "
                              "cache, by tier", ["tier"], registry=r)
        self.live_gauge = Gauge("mlxpipe_live_requests", "This key's requests waiting or generating", registry=r)
        self.running: "weakref.WeakSet" = weakref.WeakSet()  # its Generations (generation.py)
        self.generated = 0  # tokens generated for it, as /health shows them

    def started(self, generation) -> None:
        self.running.add(generation)

    def generated_tokens(self, n: int) -> None:
        self.generated += n
        self.tokens.inc(n)

    def cached_prompt(self, memory_tokens: int, disk_tokens: int) -> None:
        self.cached.labels(tier="memory").inc(memory_tokens)
        self.cached.labels(tier="disk").inc(disk_tokens)

    @property
    def live(self) -> int:
        return sum(1 for g in list(self.running) if g.live)

    def render(self) -> bytes:
        self.live_gauge.set(self.live)
        return generate_latest(self.registry)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxpipe_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("mlxpipe_time_to_first_token_seconds", "From submission to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("mlxpipe_inter_token_seconds", "Between consecutive tokens of a request",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("mlxpipe_generated_tokens", "Tokens generated", registry=r)
        self.cached = Counter("mlxpipe_prompt_tokens_cached", "Prompt tokens served from the prefix cache, by the "
                              "tier some stage took them from (disk: read back from it)", ["tier"], registry=r)
        # These two are set from the engine when scraped; the stages, from their Health.
        self.live = Gauge("mlxpipe_live_requests", "Requests waiting or generating", registry=r)
        self.recoveries = Gauge("mlxpipe_pipeline_recoveries", "Times the pipeline was rebuilt after a fault",
                                registry=r)
        self.drafted = Gauge("mlxpipe_draft_tokens_judged", "Drafted tokens (speculative decoding) the last stage judged",
                             registry=r)
        self.accepted = Gauge("mlxpipe_draft_tokens_accepted", "Drafted tokens the last stage accepted", registry=r)
        self.trials = Gauge("mlxpipe_speculation_trials", "Trial windows of speculation weighed against decoding",
                            ["paid"], registry=r)
        self.by_source = Gauge("mlxpipe_draft_tokens", "Drafted tokens the last stage judged, by what drafted them "
                               "(prompt_lookup, mtp: the model's own multi-token-prediction head, draft_model) and "
                               "whether it accepted them", ["source", "accepted"], registry=r)
        self.acceptance = Gauge("mlxpipe_draft_acceptance", "Accepted over judged drafted tokens, by source",
                                ["source"], registry=r)
        self.stages = _Stages()
        r.register(self.stages)
        self.budget = _Budget()
        r.register(self.budget)
        self.links = _Links()
        r.register(self.links)
        self.groups = _Groups()
        r.register(self.groups)
        self.embeddings = _Embeddings()
        r.register(self.embeddings)
        self.keys: Dict[bytes, KeyMeter] = {}  # one per API key that was used (the key file bounds them)

    def key(self, identity: bytes) -> KeyMeter:
        """The meter of the key known by ``identity`` (``keys.Caller.identity``)."""
        meter = self.keys.get(identity)
        if meter is None:
            meter = self.keys[identity] = KeyMeter()
        return meter

    def request(self, route: str, status: str, identity: Optional[bytes]) -> None:
        """An HTTP request answered, for everyone's view and (when a key sent it) its key's."""
        self.requests.labels(route, status).inc()
        if identity is not None:
            self.key(identity).requests.labels(route, status).inc()

    # The engine calls these as tokens arrive (see Engine.observer).
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def cached_prompt(self, memory_tokens: int, disk_tokens: int) -> None:
        self.cached.labels(tier="memory").inc(memory_tokens)
        self.cached.labels(tier="disk").inc(disk_tokens)

    def token(self, since_previous: Optional[float]) -> None:
        self.tokens.inc()
        if since_previous is not None:
            self.inter_token.observe(since_previous)

    def render(self, health, live: int, recoveries: int, drafts=None, budget=None, links=(), embedder=None) -> bytes:
        """The text exposition, with ``health`` (``Engine.health()``'s answer) and the
        engine's live requests, recoveries and draft counts (``DraftStats``) as of now,
        and the pipeline's frame times (``Engine.frame_budget()``: kind -> totals; they
        restart with a rebuilt pipeline)."""
        self.budget.kinds = budget or {}
        self.links.links = list(links)
        self.embeddings.model = embedder
        self.live.set(live)
        self.recoveries.set(recoveries)
        if drafts is not None:
            self.drafted.set(drafts.judged)
            self.accepted.set(drafts.accepted)
            self.trials.labels(paid="yes").set(drafts.paid)
            self.trials.labels(paid="no").set(drafts.trials - drafts.paid)
            for source, (judged, accepted) in drafts.by_source.items():
                self.by_source.labels(source=source, accepted="yes").set(accepted)
                self.by_source.labels(source=source, accepted="no").set(judged - accepted)
                self.acceptance.labels(source=source).set(accepted / judged if judged else 0.0)
        self.stages.snapshot = [(i, st.address, reply) for i, (st, reply, _) in enumerate(health)]
        self.groups.snapshot = [(i, st, reply) for i, (st, reply, _) in enumerate(health)]
        return generate_latest(self.registry)

