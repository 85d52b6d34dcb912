"""Prefill fairness: a long prompt never holds the others back.

Pure logic first: the scheduler's rule (shortest remaining first, no starvation,
chunks bounded in time) driven by hand and through a simulated two-stage
pipeline whose stages take a fixed time per position. Then the real thing:
``mlxpipe serve`` on a tiny model, a long prompt prefilling while short requests
come and go, and a client that hangs up mid-prefill."""

from __future__ import annotations

import heapq
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from mlxpipe.bench.common import long_text
from mlxpipe.server.core.plan import Sample, Step, StepKind, StepResult
from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.params.sampling import Sampling


def _seq(i: int, prompt_len: int, max_tokens: int = 2) -> Seq:
    return Seq(seq_id=i, prompt=[10 + (i * 7 + k) % 50 for k in range(prompt_len)], max_tokens=max_tokens,
               sampling=Sampling())


def _answer(s: Scheduler, step: Step, token: int = 7, stage_s: List[float] = ()):
    """What the last stage answers for ``step``: a token for every sampling entry (and, with
    ``stage_s``, the seconds each stage took on it)."""
    return s.on_result(StepResult(step.step_id, [Sample(e.seq_id, token) for e in step.entries if e.sample],
                                  list(stage_s)))


def _prefills(steps: List[Step]) -> List[Tuple[int, int]]:
    return [(st.entries[0].seq_id, st.entries[0].num_tokens) for st in steps if st.kind == StepKind.PREFILL]


# -- the rule, step by step ---------------------------------------------------------------


def test_a_short_prompt_takes_the_next_free_slot_ahead_of_a_long_one():
    s = Scheduler(SchedulerConfig(chunk_size=64, max_prefill_inflight=2))
    s.add(_seq(1, 1000))
    first = s.schedule()
    assert _prefills(first) == [(1, 64), (1, 64)]
    s.add(_seq(2, 20))
    assert s.schedule() == []  # both slots are the long prompt's: the short one waits for one
    _answer(s, first[0])
    # The freed slot goes to the short prompt (16 + 3 positions, then its last token, sampled).
    assert _prefills(s.schedule()) == [(2, 16)]
    _answer(s, first[1])
    assert _prefills(s.schedule()) == [(2, 3)]


def test_a_short_prompt_gets_its_first_token_after_the_chunks_in_flight():
    s = Scheduler(SchedulerConfig(chunk_size=64, max_prefill_inflight=2))
    s.add(_seq(1, 1000))
    flying = s.schedule()
    s.add(_seq(2, 20))
    long_chunks_after = 0
    got = None
    while got is None:
        done = flying.pop(0)
        for ev in _answer(s, done):
            if ev.seq.seq_id == 2:
                got = ev
        if got is None:
            new = s.schedule()
            long_chunks_after += sum(1 for sid, _ in _prefills(new) if sid == 1)
            flying += new
    # Sent after the short one arrived and before its first token: one chunk of the long
    # prompt, into the slot the short one's body freed while its last token was in flight.
    assert long_chunks_after <= 1
    assert s.seqs[1].sent < 1000 // 2


def test_equal_long_prompts_finish_one_after_the_other():
    """Shortest remaining first: among long prompts the one ahead keeps going, so the
    first finishes as if alone and none waits for all the others."""
    s = Scheduler(SchedulerConfig(chunk_size=32, max_prefill_inflight=2))
    for i in range(1, 5):
        s.add(_seq(i, 200))
    order = []
    flying = s.schedule()
    while flying:
        step = flying.pop(0)
        if step.kind == StepKind.PREFILL:
            order.append(step.entries[0].seq_id)
        _answer(s, step)
        flying += s.schedule()
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == [1, 2, 3, 4]


def test_a_long_prompt_is_never_starved_by_a_stream_of_short_ones():
    k = 4
    s = Scheduler(SchedulerConfig(chunk_size=16, max_prefill_inflight=2, max_overtaken=k, max_waiting=10_000))
    s.add(_seq(1, 400, max_tokens=1))
    next_id, flying = 2, s.schedule()
    long_steps = steps = len(flying)
    first_token = None
    while first_token is None:
        s.add(_seq(next_id, 3, max_tokens=1))  # a new short prompt at every result: always one waiting
        next_id += 1
        step = flying.pop(0)
        for ev in _answer(s, step):
            if ev.seq.seq_id == 1:
                first_token = steps
        new = s.schedule()
        for st in new:
            if st.kind == StepKind.PREFILL:
                steps += 1
                long_steps += st.entries[0].seq_id == 1
        flying += new
        assert steps < 5000, "the long prompt never finished"
    # It got at least one prefill step in every k + 1 while short prompts kept coming.
    assert long_steps * (k + 1) >= steps - (k + 1)
    assert long_steps == -(-399 // 16) + 1  # every chunk of it, and its last token


def test_max_overtaken_zero_is_arrival_order():
    s = Scheduler(SchedulerConfig(chunk_size=4, max_prefill_inflight=1, max_overtaken=0))
    s.add(_seq(1, 13))
    s.add(_seq(2, 2))
    order = []
    flying = s.schedule()
    while flying:
        step = flying.pop(0)
        order += [e.seq_id for e in step.entries if step.kind == StepKind.PREFILL]
        _answer(s, step)
        flying += s.schedule()
    assert [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k] == [1, 2]


def test_chunks_are_bounded_in_time_alone_too():
    """Whoever arrives next waits for the chunks in flight: a long prompt's chunks hold
    a stage at most max_stall seconds even with nobody else there (once a prefill step
    has been timed); max_stall 0 turns the bound off."""
    s = Scheduler(SchedulerConfig(chunk_size=256, max_prefill_inflight=2, max_stall=0.2))
    s.add(_seq(1, 4000))
    flying = s.schedule()
    assert _prefills(flying) == [(1, 256), (1, 256)]  # nothing timed yet
    _answer(s, flying[0], stage_s=[1.28, 2.56])  # the slowest stage: 0.01 s a position
    assert _prefills(s.schedule()) == [(1, 20)]  # 0.2 s / 0.01 s a position
    off = Scheduler(SchedulerConfig(chunk_size=256, max_prefill_inflight=2, max_stall=0))
    off.add(_seq(1, 4000))
    flying = off.schedule()
    _answer(off, flying[0], stage_s=[1.28, 2.56])
    assert _prefills(off.schedule()) == [(1, 256)]


def test_a_cancelled_prompt_sends_nothing_more_and_is_freed_with_the_next_step():
    s = Scheduler(SchedulerConfig(chunk_size=64, max_prefill_inflight=2))
    s.add(_seq(1, 2000))
    flying = s.schedule()
    s.cancel(1)
    s.add(_seq(2, 20))
    (control,) = s.schedule()  # the stages free it at once; its two chunks in flight still hold the slots
    assert control.kind == StepKind.CONTROL and control.free == [1]
    assert _answer(s, flying[0]) == []
    assert _prefills(s.schedule()) == [(2, 16)]
    assert _answer(s, flying[1]) == []
    assert all(sid == 2 for sid, _ in _prefills(s.schedule()))


def test_a_waiting_prompts_cached_blocks_stay_until_its_first_step():
    """A prompt admitted behind others may wait rounds for its first step: the blocks it
    starts after are not evicted meanwhile (its first step names them)."""
    b = 4
    s = Scheduler(SchedulerConfig(chunk_size=8, block_tokens=b, prefix_blocks=6, max_prefill_inflight=1,
                                  max_overtaken=1000))
    s.reset_prefix([[], []], 6)
    shared = list(range(100, 117))  # 17 tokens: 4 blocks before its last token
    s.add(Seq(seq_id=1, prompt=shared, max_tokens=1, sampling=Sampling()))
    flying = s.schedule()
    while flying:
        _answer(s, flying.pop(0))
        flying += s.schedule()
    assert s.prefix.blocks == 4
    # A long prompt of other tokens prefills (its blocks would push the old ones out) while a
    # prompt that shares the first 16 tokens, and is longer still, waits for a slot.
    s.add(Seq(seq_id=2, prompt=list(range(300, 340)), max_tokens=1, sampling=Sampling()))
    s.add(Seq(seq_id=3, prompt=shared[:16] + list(range(500, 560)), max_tokens=1, sampling=Sampling()))
    flying = s.schedule()
    assert _prefills(flying) == [(2, 8)]
    reuse = list(s.seqs[3].reuse)
    assert len(reuse) == 4
    first3 = None
    while flying:
        step = flying.pop(0)
        if step.kind == StepKind.PREFILL and step.entries[0].seq_id == 3 and step.entries[0].opening:
            first3 = step
        _answer(s, step)
        flying += s.schedule()
        if first3 is None:
            assert all(k in s.prefix.lru for k in reuse), "a block the waiting prompt starts after was evicted"
    assert first3.entries[0].opening.reuse == reuse


def test_after_a_replay_the_prompts_start_over_shortest_first():
    """A fault: every live sequence is prefilled again from its prompt plus what it
    generated; the rule holds there too, and nobody is counted as passed over before."""
    s = Scheduler(SchedulerConfig(chunk_size=64, max_prefill_inflight=2, max_overtaken=3))
    s.add(_seq(1, 1000, max_tokens=5))
    s.add(_seq(2, 30, max_tokens=5))
    flying = s.schedule()
    for _ in range(6):
        _answer(s, flying.pop(0), token=9)
        flying += s.schedule()
    assert s.seqs[2].generated and not s.seqs[1].generated  # the short one went first and decodes
    generated = list(s.seqs[2].generated)
    s.replay_all()
    assert s.seqs[1].overtaken == 0
    steps = s.schedule()
    # The short one again: its prompt and the tokens it had, first; then the long one from 0.
    assert [(e.seq_id, e.offset) for st in steps for e in st.entries] == [(2, 0), (2, 16)]
    assert steps[0].tokens + steps[1].tokens == (s.seqs[2].prompt + generated)[:len(steps[0].tokens + steps[1].tokens)]
    flying = steps
    while 1 in s.seqs and not s.seqs[1].generated:
        _answer(s, flying.pop(0), token=9)
        flying += s.schedule()
    assert s.seqs[1].sent == len(s.seqs[1].feed)


# -- a simulated pipeline: stages that take a time per position ----------------------------


class SimPipeline:
    """Two (or more) stages, each taking ``overhead + n * per_token`` seconds for a frame of
    n positions, in order; the head schedules whenever a result comes back or a request
    arrives. Returns first-token times; the scheduler is the real one."""

    def __init__(self, config: SchedulerConfig, stages: int = 2, per_token: float = 0.01, overhead: float = 0.002):
        self.s = Scheduler(config)
        self.stages, self.per_token, self.overhead = stages, per_token, overhead
        self.free_at = [0.0] * stages
        self.now = 0.0
        self.events: List[Tuple[float, int, str, object]] = []
        self._n = 0
        self.first: Dict[int, float] = {}
        self.arrived: Dict[int, float] = {}
        self.busy_until = 0.0  # the last stage's last frame's end

    def _push(self, t: float, kind: str, obj) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, obj))

    def add(self, at: float, seq: Seq) -> None:
        self._push(at, "add", seq)

    def cancel(self, at: float, seq_id: int) -> None:
        self._push(at, "cancel", seq_id)

    def _send(self) -> None:
        for step in self.s.schedule():
            n = sum(e.num_tokens for e in step.entries)
            t, took = self.now, self.overhead + n * self.per_token if n else 0.0
            for i in range(self.stages):
                start = max(t, self.free_at[i])
                t = self.free_at[i] = start + took
            self.busy_until = max(self.busy_until, t)
            self._push(t, "result", (step, [took] * self.stages))

    def run(self, until: Optional[float] = None) -> None:
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            if until is not None and t > until:
                heapq.heappush(self.events, (t, 0, kind, obj))
                return
            self.now = t
            if kind == "add":
                self.arrived[obj.seq_id] = t
                self.s.add(obj)
            elif kind == "cancel":
                self.s.cancel(obj)
            else:
                step, took = obj  # (and what each stage took: its StageTiming)
                for ev in _answer(self.s, step, stage_s=took):
                    self.first.setdefault(ev.seq.seq_id, t - self.arrived[ev.seq.seq_id])
            self._send()

    def ttft(self, seq_id: int) -> float:
        return self.first[seq_id]


def _sim(config: SchedulerConfig, arrivals, cancels=(), **kw) -> SimPipeline:
    sim = SimPipeline(config, **kw)
    for at, seq in arrivals:
        sim.add(at, seq)
    for at, sid in cancels:
        sim.cancel(at, sid)
    sim.run()
    return sim


CFG = dict(chunk_size=256, max_prefill_inflight=2, max_stall=0.2, num_groups=2)


def test_simulated_short_request_ttft_within_3x_idle_and_long_prompt_within_25_percent():
    """The issue's bar, on a simulated 2-stage pipeline: an 8,000-token prompt prefilling,
    a 20-token request arrives; its time to first token is at most 3x its idle one, and
    the long prompt's grows by at most 25%. (Warm: a prefill step was timed before.)"""
    warm = (0.0, _seq(99, 40, max_tokens=1))
    idle = _sim(SchedulerConfig(**CFG), [warm, (10.0, _seq(2, 20, max_tokens=1))]).ttft(2)
    alone = _sim(SchedulerConfig(**CFG), [warm, (10.0, _seq(1, 8000, max_tokens=1))]).ttft(1)
    for arrive in (11.0, 25.0, 60.0):
        both = _sim(SchedulerConfig(**CFG), [warm, (10.0, _seq(1, 8000, max_tokens=1)),
                                             (arrive, _seq(2, 20, max_tokens=1))])
        assert both.ttft(2) <= 3 * idle, (arrive, both.ttft(2), idle)
        assert both.ttft(1) <= 1.25 * alone
    # Before: first come, first served in full chunks, the short request waited out the long one.
    fifo = _sim(SchedulerConfig(**CFG, max_overtaken=0),
                [warm, (10.0, _seq(1, 8000, max_tokens=1)), (25.0, _seq(2, 20, max_tokens=1))])
    assert fifo.ttft(2) > 10 * idle


def test_simulated_four_long_prompts_and_short_probes():
    warm = (0.0, _seq(99, 40, max_tokens=1))
    idle = _sim(SchedulerConfig(**CFG), [warm, (10.0, _seq(2, 20, max_tokens=1))]).ttft(2)
    longs = [(10.0, _seq(i, 2000, max_tokens=1)) for i in range(10, 14)]
    probes = [(12.0 + 3 * k, _seq(20 + k, 20, max_tokens=1)) for k in range(5)]
    sim = _sim(SchedulerConfig(**CFG), [warm, *longs, *probes])
    for _, p in probes:
        assert sim.ttft(p.seq_id) <= 3 * idle
    # The long prompts finish one after the other, not all at the end.
    ends = sorted(sim.ttft(i) for i in range(10, 14))
    assert ends[0] < 0.4 * ends[-1]


def test_simulated_hang_up_frees_the_stages_within_one_chunk():
    """A prompt cancelled mid-prefill: nothing more of it is sent, and the stages are
    done with it within the chunks in flight, each at most max_stall long a stage."""
    warm = (0.0, _seq(99, 40, max_tokens=1))
    sim = SimPipeline(SchedulerConfig(**CFG))
    sim.add(*warm)
    sim.add(10.0, _seq(1, 8000, max_tokens=1))
    sim.cancel(30.0, 1)
    sim.run()
    assert 1 not in sim.first
    stages = 2
    assert sim.busy_until - 30.0 <= stages * (0.2 + sim.overhead) + 1e-9


# -- the real thing: `mlxpipe serve` on 2 stages ----------------------------------------------

LONG = 4000      # positions of the long prompt: seconds of prefill on the tiny model, many chunks
HANG = 7000      # positions of the prompt hung up on: only the first ~1,000 are computed
MAX_STALL = 0.2  # serve's default --max-stall: seconds a prefill chunk may hold a stage
CHUNK = 1024     # --chunk-size: a chunk this long holds a stage for seconds (were it not bounded in time)


@pytest.fixture(scope="module")
def fair_server(tmp_path_factory, default_model):
    """A tiny llama (long context) served on 2 stages in chunks of at most 1,024 positions, warmed."""
    from server_proc import ServerProcess
    from tiny_models import build_llama_source

    path = build_llama_source(tmp_path_factory.mktemp("fair") / "llama", default_model,
                              max_position_embeddings=8192)
    srv = ServerProcess("--model", str(path), "--stages", "2", "--chunk-size", str(CHUNK), capture_log=True)
    srv.tok = load_tokenizer(default_model)
    for i in range(2):  # kernels compiled, a prefill step timed (chunks are bounded from then on)
        _first_token(srv, long_text(srv.tok, 40, f"warm{i}"))
    yield srv
    srv.stop()


def _metric(srv, name: str) -> float:
    for line in httpx.get(f"{srv.root}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _prefilled(srv) -> float:
    """Prompt positions the pipeline has computed since start (every stage, results back)."""
    return _metric(srv, 'mlxpipe_frame_tokens_timed_total{kind="prefill"}')


def _prefill_compute(srv) -> List[float]:
    """Seconds each stage has computed prompt positions since start."""
    return [_metric(srv, f'mlxpipe_stage_frame_seconds_total{{kind="prefill",part="compute",stage="{i}"}}')
            for i in range(2)]


def _body(text: str, stream: bool) -> dict:
    return {"model": "default", "prompt": text, "max_tokens": 1, "temperature": 0, "stream": stream}


def _first_token(srv, text: str) -> Tuple[float, float]:
    """(when it was sent, when its first token came), time.monotonic()."""
    t0 = time.monotonic()
    with httpx.stream("POST", f"{srv.base_url}/completions", json=_body(text, True), timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return t0, time.monotonic()
    raise AssertionError("no token")


def _wait_for(predicate, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_short_request_is_answered_while_a_long_prompt_prefills(fair_server):
    srv, tok = fair_server, fair_server.tok
    idle = min(b - a for a, b in (_first_token(srv, long_text(tok, 20, f"idle{i}")) for i in range(2)))
    alone_sent, alone_first = _first_token(srv, long_text(tok, LONG, "alone"))
    alone = alone_first - alone_sent

    base = _prefilled(srv)
    with ThreadPoolExecutor(1) as pool:
        long_req = pool.submit(_first_token, srv, long_text(tok, LONG, "together"))
        p0 = _wait_for(lambda: (p := _prefilled(srv)) - base >= LONG // 5 and p, 300, "the long prompt's prefill")
        short_sent, short_first = _first_token(srv, long_text(tok, 20, "probe"))
        p1 = _prefilled(srv)
        long_sent, long_first = long_req.result()
    short = short_first - short_sent
    together = long_first - long_sent
    print(f"short request: idle {idle:.2f} s, beside the long prompt {short:.2f} s; long prompt: alone "
          f"{alone:.2f} s, with the short one {together:.2f} s; prefilled while the short one waited: {p1 - p0:.0f}")
    # The short request's first token came first, and while it waited the long prompt had a few
    # chunks computed (first come, first served: all that was left of it, about 4 / 5).
    assert short_first < long_first
    assert p1 - p0 < (LONG - (p0 - base)) / 3
    assert short < alone / 4
    # The long prompt paid little for it (generous: the machine is shared).
    assert together < 2 * alone


def _hang_up_mid_prefill(srv, stream: bool) -> Tuple[float, float, float]:
    """A client sends the long prompt and closes its socket mid-prefill: (prompt positions
    computed when it hung up, more computed after, seconds a position took on the slowest
    stage meanwhile)."""
    base, compute = _prefilled(srv), _prefill_compute(srv)
    payload = json.dumps(_body(long_text(srv.tok, HANG, f"hangup-{stream}"), stream)).encode()
    host, port = srv.root.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    at = _wait_for(lambda: (p := _prefilled(srv)) - base >= 500 and p, 300, "the prefill to start")
    sock.close()
    per_token = max(b - a for a, b in zip(compute, _prefill_compute(srv))) / (at - base)
    last, still = at, time.monotonic()
    while time.monotonic() - still < 1.5:  # until nothing more is computed for 1.5 s
        time.sleep(0.1)
        now = _prefilled(srv)
        if now != last:
            last, still = now, time.monotonic()
    health = httpx.get(f"{srv.root}/health", timeout=30).json()
    assert all(s["queue_depth"] == 0 for s in health["stages"])
    return at - base, last - at, per_token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_a_client_that_hangs_up_mid_prefill_frees_the_stages_within_a_chunk(fair_server, stream):
    srv = fair_server
    done, after, per_token = _hang_up_mid_prefill(srv, stream)
    chunk = MAX_STALL / per_token  # positions a stage computes in --max-stall: a chunk's size
    print(f"hung up after {done:.0f} prompt positions of {HANG}; {after:.0f} more were computed "
          f"(a chunk: about {chunk:.0f})")
    # What was in flight when the server heard of it: about a chunk per stage. (Before: two
    # chunks of --chunk-size, however long they took, and the hang-up heard of between polls.)
    assert after <= 4 * chunk < (HANG - done) / 3, (done, after, chunk)
    if not stream:
        _wait_for(lambda: any(" 499 " in line for line in srv.log), 30, "the request log's 499")
    # The stages are free: the next short request is answered, and computing it took its own
    # positions only, not what was left of the abandoned prompt (no clock: the machine is shared).
    base = _prefilled(srv)
    _first_token(srv, long_text(srv.tok, 20, f"after-{stream}"))
    assert _prefilled(srv) - base <= 100 < (HANG - done - after) / 4
