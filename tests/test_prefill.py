"""The prefill policy (``server/core/prefill.py``) is pure logic: frames' stage times in,
chunk sizes out. A frame costs ``fixed + per_token * n`` (plus a part that grows with the
context), and a chunk is as large as ``max_stall`` allows on the slowest stage."""

from __future__ import annotations

import random

import pytest

from mlxpipe.server.core.plan import Sample, StepKind, StepResult
from mlxpipe.server.core.prefill import PrefillPolicy, StageFit
from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.params.sampling import Sampling


def _seq(prompt_len: int, sent: int = 0, kv_at=None) -> Seq:
    seq = Seq(seq_id=1, prompt=[5] * prompt_len, max_tokens=1, sampling=Sampling())
    seq.feed, seq.sent, seq.kv_at = list(seq.prompt), sent, kv_at
    return seq


def _cost(fixed: float, per_token: float, per_context: float = 0.0):
    """Seconds a frame of n positions from ``offset`` takes: the model the policy fits."""
    return lambda n, offset: fixed + per_token * n + per_context * (n * offset + n * n / 2)


def _feed(policy: PrefillPolicy, frames, *costs) -> None:
    """Each (offset, n) frame, timed on one stage per cost model."""
    for offset, n in frames:
        policy.observe(offset, n, [c(n, offset) for c in costs])


def _old_rule(policy_frames, cost, max_stall: float) -> int:
    """What the scheduler did before: the last frames' seconds per position (an EMA, here
    the last frame's), the chunk max_stall over it."""
    offset, n = policy_frames[-1]
    return int(max_stall / (cost(n, offset) / n))


def test_a_chunk_is_what_fits_beside_the_fixed_part():
    """Frames of two sizes tell the fixed part from the per-position one; the chunk is then
    (max_stall - fixed) / per_token, where the per-position rule cut it to a fifth."""
    cost = _cost(fixed=0.15, per_token=0.0005)  # a small model: most of a small frame is fixed
    p = PrefillPolicy(SchedulerConfig(chunk_size=256, min_chunk=16, max_stall=0.2))
    frames = [(0, 256), (256, 256), (512, 256), (768, 40), (808, 40), (848, 40)]
    _feed(p, frames, cost)
    fit = p.stages[0]  # (a few frames: the fit's pull to "no fixed part" still shows)
    assert fit.fixed == pytest.approx(0.15, rel=0.05)
    assert fit.per_token(900) == pytest.approx(0.0005, rel=0.1)
    n = p.chunk(_seq(4000, sent=900))
    assert n == pytest.approx(100, abs=3)  # 0.15 + 100 * 0.0005 = 0.2
    assert cost(n, 900) == pytest.approx(0.2, rel=0.01)
    assert _old_rule(frames, cost, 0.2) == 47  # ... where 0.2 s / (0.17 s / 40 positions) gave 47


def test_the_cost_follows_the_context_as_the_prompt_grows():
    """Attention: a position costs more the more positions precede it. Fitted on the frames
    so far, the next chunk's cost is known where it starts, further on: within max_stall,
    where the last frame's cost per position (measured nearer the start) overshoots."""
    cost = _cost(fixed=0.01, per_token=0.0002, per_context=1e-7)
    p = PrefillPolicy(SchedulerConfig(chunk_size=256, min_chunk=16, max_stall=0.2))
    frames = [(o, 256) for o in range(0, 4096, 256)] + [(4096 + 128 * k, 128) for k in range(8)]
    _feed(p, frames, cost)
    at = 8192  # the next chunk starts further on than any frame measured
    n = p.chunk(_seq(20000, sent=at))
    assert cost(n, at) <= 0.2 < cost(n + 2, at)
    old = _old_rule(frames, cost, 0.2)
    assert cost(old, at) > 0.2 * 1.2, (old, n)


def test_the_slowest_stage_bounds_the_chunk():
    fast, slow = _cost(0.01, 0.0002), _cost(0.05, 0.001)
    p = PrefillPolicy(SchedulerConfig(chunk_size=256, min_chunk=16, max_stall=0.2))
    _feed(p, [(0, 256), (256, 100), (356, 150), (506, 60)], fast, slow, fast)
    assert p.chunk(_seq(4000, sent=600)) == pytest.approx(150, abs=2)  # (0.2 - 0.05) / 0.001


def test_never_under_min_chunk_nor_over_chunk_size_nor_the_prompt():
    cfg = SchedulerConfig(chunk_size=256, min_chunk=16, max_stall=0.2)
    p = PrefillPolicy(cfg)
    assert p.chunk(_seq(4000)) == 256  # nothing timed yet: no bound
    _feed(p, [(0, 256), (256, 32)], _cost(0.3, 0.001))  # even a frame of nothing takes longer than 0.2 s
    assert p.chunk(_seq(4000, sent=300)) == 16
    cheap = PrefillPolicy(cfg)
    _feed(cheap, [(0, 256), (256, 32)], _cost(0.001, 1e-6))
    assert cheap.chunk(_seq(4000, sent=300)) == 256
    assert cheap.chunk(_seq(400, sent=300)) == 99  # all but the last token
    off = PrefillPolicy(SchedulerConfig(chunk_size=256, min_chunk=16, max_stall=0))
    _feed(off, [(0, 256), (256, 32)], _cost(0.3, 0.001))
    assert off.chunk(_seq(4000, sent=300)) == 256  # max_stall 0: no bound


def test_a_short_prefill_is_cut_for_every_stage_and_no_chunk_crosses_the_kv_switch():
    p = PrefillPolicy(SchedulerConfig(chunk_size=256, min_chunk=16, max_prefill_inflight=2))
    assert p.chunk(_seq(201)) == 50  # about two chunks per stage in flight
    assert p.chunk(_seq(41)) == 16   # never under min_chunk
    assert p.chunk(_seq(4000, sent=100, kv_at=300)) == 200  # up to the switch, then on from it
    assert p.chunk(_seq(4000, sent=300, kv_at=300)) == 256


def test_with_state_caches_chunks_end_at_block_boundaries():
    p = PrefillPolicy(SchedulerConfig(chunk_size=50, min_chunk=16, block_tokens=16))
    assert p.chunk(_seq(200, sent=10)) == 50  # no state caches: wherever
    p.snapshot_every = 4
    assert p.chunk(_seq(200, sent=10)) == 38   # to 48, a block's end
    assert p.chunk(_seq(200, sent=150)) == 42  # to 192, the body's last block end, before its tail
    assert p.chunk(_seq(200, sent=192)) == 7   # the tail


def test_noisy_timings_never_give_a_negative_term_and_stay_near_the_bound():
    rng = random.Random(0)
    cost = _cost(fixed=0.08, per_token=0.001)
    fit = StageFit()
    for k in range(200):
        n = rng.choice([60, 90, 120, 256])
        fit.add(n, 256 * k, cost(n, 0) * rng.lognormvariate(0, 0.2))
        assert min(fit.fit) >= 0
    assert 0.8 * 120 <= fit.tokens_within(0.2, 256 * 200) <= 1.2 * 120


def test_the_scheduler_times_unsampled_prefill_steps_only_and_forgets_them_on_a_replay():
    s = Scheduler(SchedulerConfig(chunk_size=256, min_chunk=16, max_prefill_inflight=1, max_stall=0.2))
    s.add(Seq(seq_id=1, prompt=[5] * 2000, max_tokens=1, sampling=Sampling()))
    s.add(Seq(seq_id=2, prompt=[6] * 10, max_tokens=1, sampling=Sampling()))
    (short,) = s.schedule()
    assert short.entries[0].num_tokens == 9
    s.on_result(StepResult(short.step_id, [], [9 * 0.01]))
    (last,) = s.schedule()
    assert last.entries[0].sample
    s.on_result(StepResult(last.step_id, [Sample(2, 7)], [30.0]))  # the output head: no prefill cost
    (long,) = s.schedule()
    assert long.kind == StepKind.PREFILL and long.entries[0].num_tokens == 20  # 0.2 s at 0.01 s a position
    s.replay_all()
    assert [st.entries[0].num_tokens for st in s.schedule()] == [256]  # a new pipeline: not timed yet
