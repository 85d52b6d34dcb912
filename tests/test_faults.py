"""Faults and load: a lost node costs a pause, never an answer.

Every test here is bounded in time (run_async's deadline) and checks the
answers against single-process mlx-lm on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from conftest import REPEAT_CODE, SECRET, run_async
from faultproxy import FaultProxy
from server_proc import ServerProcess

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.stage_client import Pipeline
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.server.core.supervision import Supervision

STREAMS = 8
NEW_TOKENS = 60
FAST = Supervision(health_interval_s=0.5, health_timeout_s=1.5)
SECURE = Security(secret=SECRET)


def _prompts(n=STREAMS):
    return [[11 + i, 400 + 7 * i, 90, 3000 + i, 5 + i * 13][: 2 + i % 4] for i in range(n)]


async def _until(predicate, timeout: float, what: str, step: float = 0.05) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)
    return time.monotonic() - t0


def _shared_prefix_prompts(n=STREAMS):
    """Prompts of an agent-like workload: a 48-token prefix they all share, distinct tails."""
    prefix = [(37 * i + 11) % 4000 + 100 for i in range(48)]
    return [prefix + p for p in _prompts(n)]


async def _generate_through_fault(cluster, fault, prompts=None):
    """Start 8 streams; once each has a few tokens, call fault(); collect everything."""
    prompts = prompts or _prompts()
    streams = [cluster.engine.submit(p, NEW_TOKENS) for p in prompts]
    got = [[] for _ in streams]
    times = [[] for _ in streams]

    async def consume(i, s):
        async for t in s:
            got[i].append(t.id)
            times[i].append(time.monotonic())

    tasks = [asyncio.ensure_future(consume(i, s)) for i, s in enumerate(streams)]
    await _until(lambda: min(map(len, got)) >= 5, 60, "every stream to start")
    assert max(map(len, got)) < NEW_TOKENS, "the fault must land mid-stream"
    info = await fault()
    await asyncio.gather(*tasks)
    pause = max(b - a for ts in times for a, b in zip(ts, ts[1:]))
    # The record in docs/reliability.md comes from these lines (pytest -s).
    print(f"\n[record] {len(streams)} streams, {sum(len(g) == NEW_TOKENS for g in got)} finished with "
          f"{NEW_TOKENS} tokens; fault noticed after {info if info is not None else float('nan'):.2f} s; "
          f"longest pause between tokens {pause:.2f} s; recoveries {cluster.engine.stats.recoveries}")
    return prompts, got, info


async def _stage_stats(cluster):
    return [(reply.prefix_blocks, reply.stats.reused_tokens) for _, reply, _ in await cluster.pipeline.health()]


def _check(model, prompts, got, reference):
    for p, out in zip(prompts, got):
        assert out == reference(model, p, NEW_TOKENS), "output differs from an undisturbed run"


async def _noticed(cluster, timeout=10):
    """Seconds until the engine left "ready" (or already came back: a tiny model recovers fast)."""
    done = cluster.engine.stats.recoveries
    return await _until(lambda: cluster.engine.state != "ready" or cluster.engine.stats.recoveries > done,
                        timeout, "the fault to be noticed")


def test_kill_9_stage_restarted_in_place(dsv3_model, reference):
    async def main():
        cfg = ClusterConfig(model=str(dsv3_model), stages=2, split="even", supervision=FAST)
        async with Cluster(cfg) as cluster:
            addresses = [st.address for st in cluster.pipeline.stages]

            async def fault():
                os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
                return await _noticed(cluster)

            prompts, got, noticed = await _generate_through_fault(cluster, fault)
            await cluster.engine.drain()
            health = await cluster.pipeline.health()
            return (prompts, got, noticed, addresses, [st.address for st in cluster.pipeline.stages], health,
                    cluster.engine.stats.recoveries)

    prompts, got, noticed, before, after, health, recoveries = run_async(main(), timeout=240)
    _check(dsv3_model, prompts, got, reference)
    assert noticed < 5 and recoveries == 1
    assert after == before  # the same two addresses, one of them a new process
    assert all(h.state == "ready" and list(h.live_seqs) == [] for _, h, _ in health)


@pytest.mark.extended  # (kills while verifying: test_draft_model and test_mtp, extended too; a kill mid-stream stays in the default run)
def test_kill_9_while_verifying_drafts(default_model, reference):
    """One stream copying code from its prompt decodes speculatively; stage 1 is
    killed with drafts in flight: the replay gives the same tokens as mlx-lm."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model)
    prompt = tok.apply_chat_template([{"role": "user", "content": REPEAT_CODE}], add_generation_prompt=True)

    async def main():
        cfg = ClusterConfig(model=str(default_model), stages=2, split="even", supervision=FAST)
        async with Cluster(cfg) as cluster:
            drafts = cluster.engine.scheduler.drafts
            stream = cluster.engine.submit(prompt, NEW_TOKENS)
            got, judged, at = [], None, 0
            async for t in stream:
                got.append(t.id)
                if judged is None and drafts.accepted >= 4 and cluster.engine.scheduler.solo:
                    judged, at = drafts.judged, len(got)  # drafts are in flight now
                    os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
            return got, judged, at, cluster.engine.stats.recoveries, drafts.judged

    got, judged_at_fault, at, recoveries, judged = run_async(main(), timeout=240)
    assert judged_at_fault is not None and at < len(got) - 8, "the fault must land while speculating"
    assert recoveries == 1
    assert got == reference(default_model, prompt, NEW_TOKENS)
    assert judged > judged_at_fault, "the replayed sequence speculates again"


def test_kill_9_under_a_cached_workload(dsv3_model, reference):
    """8 streams that start from a cached prefix; stage 1 killed mid-decode and
    restarted empty: no stage may start after blocks it lacks, answers stay right."""
    async def main():
        cfg = ClusterConfig(model=str(dsv3_model), stages=2, split="even", supervision=FAST)
        async with Cluster(cfg) as cluster:
            prompts = _shared_prefix_prompts()
            await collect(cluster.engine.submit(prompts[0], 4))  # caches the shared prefix
            cached = []

            async def fault():
                cached.extend(s.cached_tokens for s in cluster.engine.streams.values())
                os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
                return await _noticed(cluster)

            _, got, noticed = await _generate_through_fault(cluster, fault, prompts)
            await cluster.engine.drain()
            return prompts, got, noticed, cached, await _stage_stats(cluster)

    prompts, got, noticed, cached, stats = run_async(main(), timeout=240)
    _check(dsv3_model, prompts, got, reference)
    assert noticed < 5 and len(cached) == STREAMS and min(cached) >= 32
    # Stage 0 kept its blocks through the rebuild; the new stage 1 got blocks again from the replays.
    assert all(blocks > 0 for blocks, _ in stats)


def test_a_stage_back_within_the_rejoin_time_keeps_its_cache_for_the_replay(dsv3_model, reference):
    """A node stalls (SIGSTOP) and comes back before the head gives up on it: the
    rebuilt pipeline is the same, every stage still holds its prefix blocks, and
    the replayed sequences start from them instead of from token 0."""
    nodes = [_node("127.0.0.1:0", dsv3_model.parent) for _ in range(2)]
    try:
        async def main():
            cfg = ClusterConfig(model=str(dsv3_model), nodes=[a for _, a in nodes], split="even",
                                rejoin_timeout_s=30.0, supervision=FAST, security=SECURE)
            async with Cluster(cfg) as cluster:
                prompts = _shared_prefix_prompts()
                await collect(cluster.engine.submit(prompts[0], 4))
                before = []

                async def fault():
                    before.extend(await _stage_stats(cluster))
                    nodes[1][0].send_signal(signal.SIGSTOP)
                    noticed = await _noticed(cluster)
                    await asyncio.sleep(0.5)
                    nodes[1][0].send_signal(signal.SIGCONT)
                    return noticed

                _, got, noticed = await _generate_through_fault(cluster, fault, prompts)
                return (prompts, got, noticed, before, await _stage_stats(cluster),
                        [st.address for st in cluster.pipeline.stages], cluster.engine.stats.recoveries)

        prompts, got, noticed, before, after, stages, recoveries = run_async(main(), timeout=240)
        _check(dsv3_model, prompts, got, reference)
        assert noticed < 5 and recoveries == 1 and stages == [a for _, a in nodes]
        # The 8 replays took at least the shared prefix's 3 blocks each from the caches that survived.
        assert all(b[1] - a[1] >= STREAMS * 48 for a, b in zip(before, after)), (before, after)
    finally:
        for proc, _ in nodes:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_kill_9_one_of_three_replans_onto_two(dsv3_model, reference):
    async def main():
        cfg = ClusterConfig(model=str(dsv3_model), stages=3, split="even", restart=False, supervision=FAST)
        async with Cluster(cfg) as cluster:
            victim = cluster.pipeline.stages[1].address

            async def fault():
                os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
                return await _noticed(cluster)

            prompts, got, noticed = await _generate_through_fault(cluster, fault)
            ranges = [(st.start, st.end) for st in cluster.pipeline.stages]
            return prompts, got, noticed, victim, [st.address for st in cluster.pipeline.stages], ranges

    prompts, got, noticed, victim, addresses, ranges = run_async(main(), timeout=240)
    _check(dsv3_model, prompts, got, reference)
    assert noticed < 5
    assert len(addresses) == 2 and victim not in addresses
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 4


def _node(listen: str, models_dir, netns: str = "") -> tuple:
    """A stage worker process the head did not start (it cannot restart it)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "mlxpipe.shards.worker.node", "--listen", listen,
                             "--models-dir", str(models_dir), "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True, env=os.environ | {"MLXPIPE_SECRET": SECRET})
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split()[-1]


async def _live_seqs(address: str):
    probe = Pipeline([address], "unused", SECURE)
    try:
        (_, reply, _), = await probe.health()
        return None if reply is None else list(reply.live_seqs)
    finally:
        await probe.close()


def test_stalled_stage_is_handled_like_a_dead_one(dsv3_model, reference):
    """SIGSTOP a node the head cannot restart: noticed within 5 s, its layers
    re-planned over the others; after SIGCONT it holds no sequence."""
    nodes = [_node("127.0.0.1:0", dsv3_model.parent) for _ in range(3)]
    try:
        async def main():
            cfg = ClusterConfig(model=str(dsv3_model), nodes=[a for _, a in nodes], split="even",
                                rejoin_timeout_s=1.0, supervision=FAST, security=SECURE)
            async with Cluster(cfg) as cluster:
                async def fault():
                    nodes[1][0].send_signal(signal.SIGSTOP)
                    return await _noticed(cluster)

                prompts, got, noticed = await _generate_through_fault(cluster, fault)
                remaining = [st.address for st in cluster.pipeline.stages]
                nodes[1][0].send_signal(signal.SIGCONT)
                # Woken, the node finds its streams gone and frees what they brought.
                live = None
                for _ in range(100):
                    live = await _live_seqs(nodes[1][1])
                    if live == []:
                        break
                    await asyncio.sleep(0.1)
                # And the pipeline it was dropped from still answers right.
                after = [t.id async for t in cluster.engine.submit(_prompts(1)[0], NEW_TOKENS)]
                return prompts, got, noticed, remaining, live, after

        prompts, got, noticed, remaining, live, after = run_async(main(), timeout=240)
        _check(dsv3_model, prompts, got, reference)
        assert noticed < 5
        assert nodes[1][1] not in remaining and len(remaining) == 2
        assert live == [], "the stalled node leaked sequences"
        assert after == reference(dsv3_model, _prompts(1)[0], NEW_TOKENS)
    finally:
        for proc, _ in nodes:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


# -- a network of namespaces ---------------------------------------------------------


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def netns():
    """Two hosts in network namespaces of their own, each on a veth pair to this
    one (10.77.{1,2}.2, reached at 10.77.{1,2}.1), the first link rate-limited."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root and has both)")
    tag = f"{os.getpid() % 10000}"
    hosts = []
    try:
        for i in (1, 2):
            ns, outer, inner = f"mlxp{tag}h{i}", f"mlxp{tag}v{i}", f"mlxp{tag}n{i}"
            _sh("ip", "netns", "add", ns)
            hosts.append(ns)
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "addr", "add", f"10.77.{i}.1/24", "dev", outer)
            _sh("ip", "link", "set", outer, "up")
            for cmd in (["ip", "addr", "add", f"10.77.{i}.2/24", "dev", inner], ["ip", "link", "set", inner, "up"],
                        ["ip", "link", "set", "lo", "up"], ["ip", "route", "add", "default", "via", f"10.77.{i}.1"]):
                _sh("ip", "netns", "exec", ns, *cmd)
        _sh("tc", "qdisc", "add", "dev", f"mlxp{tag}v1", "root", "tbf", "rate", "40mbit", "burst", "64kb",
            "latency", "100ms")
    except subprocess.CalledProcessError as err:
        for ns in hosts:
            subprocess.run(["ip", "netns", "del", ns])
        pytest.skip(f"this machine forbids network namespaces: {err.stderr.decode().strip()}")
    yield hosts
    for ns in hosts:
        subprocess.run(["ip", "netns", "del", ns])


@pytest.mark.extended  # a minute of injected faults: CI's second run
def test_delay_jitter_stalls_and_a_partition_between_hosts(netns, dsv3_model, reference):
    """Stages on two hosts; the second behind a proxy adding delay, jitter and
    loss-like stalls: answers stay right. Then the proxy partitions the second
    host away: handled like a dead node, the layers move to the first."""
    a, a_addr = _node("10.77.1.2:50051", dsv3_model.parent, netns=netns[0])
    b, b_addr = _node("10.77.2.2:50051", dsv3_model.parent, netns=netns[1])
    proxy = FaultProxy("10.77.2.1", "10.77.2.2", 50051)
    proxy.set(delay=0.02, jitter=0.015, stall=0.2, stall_p=0.05)
    try:
        async def main():
            cfg = ClusterConfig(model=str(dsv3_model), nodes=[a_addr, proxy.address], split="even",
                                rejoin_timeout_s=1.0, supervision=FAST, security=SECURE)
            async with Cluster(cfg) as cluster:
                prompts = _prompts(4)
                outs = await asyncio.gather(*(collect(cluster.engine.submit(p, NEW_TOKENS)) for p in prompts))
                slow = [[t.id for t in out] for out in outs]
                moved = proxy.bytes

                async def fault():
                    proxy.partition()
                    return await _noticed(cluster)

                _, got, noticed = await _generate_through_fault(cluster, fault)
                return prompts, slow, moved, got, noticed, [st.address for st in cluster.pipeline.stages]

        prompts, slow, moved, got, noticed, remaining = run_async(main(), timeout=300)
        for p, out in zip(prompts, slow):
            assert out == reference(dsv3_model, p, NEW_TOKENS)
        assert moved > 10_000, "activations crossed the proxy"
        _check(dsv3_model, _prompts(), got, reference)
        assert noticed < 5
        assert remaining == [a_addr]
    finally:
        proxy.close()
        for proc in (a, b):
            proc.kill()
            proc.wait()


# -- load ------------------------------------------------------------------------------


@pytest.mark.extended  # (64 clients: test_context's waits for room in the default run)
def test_64_concurrent_clients_finish_or_get_backpressure(dsv3_model):
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "2", "--split", "even", "--max-batch", "8",
                        "--max-waiting", "16")
    try:
        def stage_memory():
            h = httpx.get(f"{srv.root}/health", timeout=10).json()
            return [(s["live_sequences"], s["cache_bytes"]) for s in h["stages"]]

        baseline = stage_memory()

        async def one(http, i):
            body = {"model": "default", "prompt": [7 + i, 300 + i, 42], "max_tokens": 40, "temperature": 0.7,
                    "seed": i, "stream": True}
            async with http.stream("POST", f"{srv.base_url}/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return resp.status_code, resp.headers.get("retry-after"), None
                lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
                return 200, None, lines

        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as http:
                return await asyncio.gather(*(one(http, i) for i in range(64)))

        results = run_async(main(), timeout=300)
        codes = [c for c, _, _ in results]
        assert all(c in (200, 429) for c in codes), f"only success or backpressure: {sorted(set(codes))}"
        assert codes.count(200) >= 16 and codes.count(429) >= 1
        for code, retry, lines in results:
            if code == 429:
                assert retry is not None
            else:
                assert lines[-1] == "data: [DONE]"
                assert any('"finish_reason":"length"' in x or '"finish_reason":"stop"' in x for x in lines)
        deadline = time.monotonic() + 20
        while stage_memory() != baseline and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"\n[record] 64 clients: {codes.count(200)} finished, {codes.count(429)} refused with 429 + "
              f"Retry-After, {len(codes) - codes.count(200) - codes.count(429)} other; "
              f"stage (live sequences, KV bytes) before {baseline}, after {stage_memory()}")
        assert stage_memory() == baseline == [(0, 0), (0, 0)]
    finally:
        srv.stop()


# -- kill -9 through the HTTP API ----------------------------------------------------------

HTTP_TOKENS = 24
PREFILL_TOKENS = 1200  # in chunks of 16: a prefill that lasts long enough to be hit


@pytest.fixture(scope="module")
def three_stage_server(dsv3_model):
    # No prefix cache: each round's prompts must be prefilled in full, or the
    # kill "during prefill" would land after it.
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "3", "--split", "even", "--chunk-size", "16",
                        "--prefix-cache-bytes", "0")
    yield srv
    srv.stop()


def _long_prompts(n=STREAMS):
    return [[(31 * i + 7 * j) % 4000 + 50 for j in range(PREFILL_TOKENS)] for i in range(n)]


async def _http_round(srv, kill=None):
    """8 streaming completions; ``kill`` = (stage, "prefill" | "decode"): SIGKILL that
    stage process then. Returns (texts, statuses, error events, /health and /metrics
    statuses seen meanwhile, whether any stream had a token at the kill)."""
    from mlxpipe.bench.soak import stage_pids

    progress = [0] * STREAMS
    seen = []
    stop = asyncio.Event()

    async def one(http, i, prompt):
        body = {"model": "default", "prompt": prompt, "max_tokens": HTTP_TOKENS, "temperature": 0, "stream": True}
        async with http.stream("POST", f"{srv.base_url}/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return resp.status_code, None, False
            text = []
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return 200, None, True
                    text.append(event["choices"][0]["text"])
                    progress[i] += 1
            return 200, "".join(text), False

    async def monitor(http):
        while not stop.is_set():
            for route in ("/health", "/metrics"):
                seen.append((await http.get(f"{srv.root}{route}")).status_code)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=STREAMS + 4)) as http:
        watcher = asyncio.ensure_future(monitor(http))
        tasks = [asyncio.ensure_future(one(http, i, p)) for i, p in enumerate(_long_prompts())]
        had_token = None
        if kill is not None:
            stage, when = kill
            if when == "prefill":  # as soon as all 8 are in: their prompts take seconds in chunks of 16
                while (await http.get(f"{srv.root}/health")).json()["live_requests"] < STREAMS:
                    await asyncio.sleep(0.01)
            else:
                await _until(lambda: min(progress) >= 3, 60, "every stream to start")
            health = (await http.get(f"{srv.root}/health")).json()
            had_token = any(progress)
            os.kill(stage_pids(srv.proc.pid, [s["address"] for s in health["stages"]])[stage], signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        stop.set()
        await watcher
        metrics = (await http.get(f"{srv.root}/metrics")).text
    return results, seen, had_token, metrics


@pytest.mark.parametrize("stage,when", [(0, "prefill"), pytest.param(1, "decode", marks=pytest.mark.extended),
                                         pytest.param(0, "decode", marks=pytest.mark.extended),
                                         pytest.param(1, "prefill", marks=pytest.mark.extended)])
def test_kill_9_through_the_http_api(three_stage_server, stage, when):
    """Stage 0 and the middle one of three, killed during prefill and during decode,
    under 8 streaming HTTP clients: every answer equals the undisturbed one, and
    nothing answers 5xx but /health's documented 503 during the pause."""
    undisturbed = getattr(three_stage_server, "undisturbed", None)
    if undisturbed is None:
        results, _, _, _ = run_async(_http_round(three_stage_server), timeout=300)
        assert all(status == 200 and text for status, text, _ in results)
        undisturbed = three_stage_server.undisturbed = [text for _, text, _ in results]
    results, seen, had_token, metrics = run_async(_http_round(three_stage_server, (stage, when)), timeout=300)
    assert had_token == (when == "decode"), "the kill did not land in the phase it names"
    assert [r[0] for r in results] == [200] * STREAMS and not any(r[2] for r in results)
    assert [text for _, text, _ in results] == undisturbed, "output differs from an undisturbed run"
    assert set(seen) <= {200, 503}, sorted(set(seen))
    assert 'status="500"' not in metrics


def test_a_pipeline_lost_mid_stream_ends_with_an_error_event_and_health_503(dsv3_model):
    """The one stage killed and not restarted: no stage is left, so the streams end
    with OpenAI's error event and /health answers 503 with the reason (the app
    over uvicorn, in this process)."""
    import uvicorn

    from mlxpipe.server.api.app import create_app
    from mlxpipe.server.api.options import ApiOptions

    async def main():
        cfg = ClusterConfig(model=str(dsv3_model), stages=1, restart=False, supervision=FAST)
        async with Cluster(cfg) as cluster:
            server = uvicorn.Server(uvicorn.Config(create_app(cluster, ApiOptions(model_id="m")), host="127.0.0.1",
                                                   port=0, log_level="warning", lifespan="off"))
            serving = asyncio.ensure_future(server.serve())
            await _until(lambda: server.started, 30, "uvicorn")
            root = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
            got = [0, 0]

            async def stream(http, i):
                body = {"model": "m", "prompt": _prompts()[i], "max_tokens": 200, "temperature": 0, "stream": True}
                async with http.stream("POST", f"{root}/v1/completions", json=body) as resp:
                    events = []
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            got[i] += 1
                    return resp.status_code, events

            async with httpx.AsyncClient(timeout=120) as http:
                tasks = [asyncio.ensure_future(stream(http, i)) for i in range(2)]
                await _until(lambda: min(got) >= 3, 60, "both streams to start")
                os.kill(cluster.local.procs[0].pid, signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                health = await http.get(f"{root}/health")
                metrics = await http.get(f"{root}/metrics")
            server.should_exit = True
            await serving
            return results, health, metrics

    results, health, metrics = run_async(main(), timeout=240)
    for status, events in results:
        assert status == 200
        last = json.loads(events[-1]) if events[-1] != "[DONE]" else json.loads(events[-2])
        assert last["error"]["code"] == "pipeline_unavailable" and last["error"]["message"], last
    assert health.status_code == 503 and health.json()["reason"], health.text
    assert metrics.status_code == 200  # stages down, figures still there; the 503 counted
    assert 'mlxpipe_http_requests_total{route="/health",status="503"} 1.0' in metrics.text, metrics.text
