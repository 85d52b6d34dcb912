"""Per-key policy, pure logic: the scheduler's priority classes (``core/priority.py``) and each
key's limits (``api/quotas.py``) on a clock the test moves."""

from __future__ import annotations

import pytest
from inproc import WiredScheduler as Scheduler

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.keys import Keys
from mlxpipe.server.api.quotas import Quotas
from mlxpipe.server.core.priority import BATCH, INTERACTIVE, effective
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Phase, Seq
from mlxpipe.shards.params.sampling import Sampling


def seq(i, priority=INTERACTIVE, prompt_len=5):
    return Seq(seq_id=i, prompt=list(range(10, 10 + prompt_len)), max_tokens=4, sampling=Sampling(),
               priority=priority)


def test_an_interactive_request_overtakes_a_queue_of_batch_ones():
    s = Scheduler(SchedulerConfig(num_groups=2, max_batch=2, max_prefill_inflight=2, chunk_size=64))
    for i in range(1, 21):
        s.add(seq(i, BATCH))
    inflight = s.schedule()  # (no interactive request yet: batch prefills take both slots)
    running = [x for x in s.seqs.values() if x.phase != Phase.WAITING]
    assert len(running) == 3  # 4 places, one left for an interactive request
    s.add(seq(99))
    assert s.schedule() == [] and s.seqs[99].phase == Phase.PREFILL  # admitted at once, past 17 batch ones
    s.on_result(pb.Result(frame_id=inflight[0].frame_id))  # a batch step in flight comes back
    frames = s.schedule()
    assert frames[0].seqs[0].seq_id == 99  # the interactive prompt's step goes first
    batch_prefills = [f for f in frames if f.kind == pb.Frame.PREFILL and f.seqs[0].seq_id != 99]
    assert not batch_prefills  # and batch keeps a slot free for it while it runs


def test_batch_gets_a_bounded_share_and_is_never_starved():
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=1, max_running=1, max_prefill_inflight=1))
    s.add(seq(1, BATCH))
    for i in range(2, 40):
        s.add(seq(i))
    order = []
    for _ in range(60):
        for f in s.schedule():
            if f.kind == pb.Frame.PREFILL and f.seqs[0].sample:
                order.append(f.seqs[0].seq_id)
            s.on_result(pb.Result(frame_id=f.frame_id, tokens=[
                pb.TokenResult(seq_id=e.seq_id, token=7) for e in f.seqs if e.sample]))
        if 1 in order:
            break
    assert 1 in order and order.index(1) <= 5  # after at most `batch_share` interactive ones


def test_a_request_lowers_itself_never_raises():
    assert effective(INTERACTIVE, priority=1) == BATCH and effective(INTERACTIVE, service_tier="flex") == BATCH
    assert effective(BATCH, priority=-5) == BATCH and effective(BATCH, service_tier="priority") == BATCH
    assert effective(INTERACTIVE, service_tier="default") == INTERACTIVE


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def quotas(line: str):
    keys, clock = Keys([f"k {line}"]), Clock()
    return Quotas(keys, clock), keys.callers[0].identity, clock


def refused(fn) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn()
    return err.value


def test_requests_per_minute():
    q, me, clock = quotas("rpm=2")
    q.admit(me).release()
    clock.now += 10
    q.admit(me).release()
    err = refused(lambda: q.admit(me))
    assert err.status == 429 and err.param == "rpm" and "2 requests per minute" in err.message
    assert err.headers["Retry-After"] == "50"  # the first leaves the window in 50 s
    clock.now += 50
    q.admit(me)


def test_tokens_per_minute_count_prompt_and_reply():
    q, me, clock = quotas("tpm=100")
    a = q.admit(me, 40)
    a.tokens(50)  # its reply
    a.release()
    err = refused(lambda: q.admit(me, 20))
    assert err.status == 429 and err.param == "tpm" and err.headers["Retry-After"] == "60"
    q.admit(me, 10)  # what fits still goes


def test_concurrent_requests_and_models():
    q, me, _ = quotas("concurrency=1 models=a,b")
    first = q.admit(me)
    err = refused(lambda: q.admit(me))
    assert err.status == 429 and err.param == "concurrency" and err.headers["Retry-After"] == "1"
    first.release()
    q.admit(me)
    q.check_model(me, "b")
    err = refused(lambda: q.check_model(me, "c"))
    assert err.status == 403 and "'a', 'b'" in err.message


@pytest.mark.parametrize("line, words", [("rpm=0", "at least 1"), ("priority=urgent", "interactive, batch"),
                                         ("models=", "at least one"), ("tpm=ten", "whole number")])
def test_a_bad_field_names_what_is_allowed(line, words):
    with pytest.raises(ValueError) as err:
        Keys([f"k {line}"])
    assert words in str(err.value) and "API key 1" in str(err.value)


def test_batch_decode_waits_while_an_interactive_prompt_prefills():
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=4, max_prefill_inflight=2, chunk_size=64))
    s.add(seq(1, BATCH))
    for f in s.schedule():  # its prefill: it joins the group
        s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=1, token=7)]))
    assert s.decoding == 1
    s.add(seq(2, prompt_len=40))
    kinds = [f.kind for f in s.schedule()]
    assert pb.Frame.DECODE not in kinds and pb.Frame.PREFILL in kinds  # the batch group holds back


def test_batch_chunks_stay_within_max_stall_below_min_chunk_while_batch_runs():
    """A batch prompt's chunks hold a stage at most ``max_stall`` at the measured cost, down to one
    position (an interactive prompt may come at any moment and wait behind them); an interactive
    prompt's keep ``min_chunk``."""
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=4, max_prefill_inflight=2, chunk_size=64,
                                  max_stall=0.2, min_chunk=16))
    s.core.prefill.observe(0, 16, [0.05 + 0.05 * 16])  # a stage: 0.05 s a frame, 0.05 s a position
    s.add(seq(1, BATCH, prompt_len=40))
    frames = [f.seqs[0].num_tokens for f in s.schedule()]
    assert frames == [3, 3]  # (0.2 - 0.05) / 0.05 positions, not min_chunk
    alone = Scheduler(SchedulerConfig(max_prefill_inflight=2, chunk_size=64, max_stall=0.2, min_chunk=16))
    alone.core.prefill.observe(0, 16, [0.05 + 0.05 * 16])
    alone.add(seq(3, prompt_len=40))
    assert [f.seqs[0].num_tokens for f in alone.schedule()] == [16, 16]  # no batch: min_chunk holds


def test_batch_chunks_may_take_twice_a_frames_fixed_part_where_that_alone_is_over_max_stall():
    """On a loaded machine a frame's fixed part may be over ``max_stall``: one position a frame would then
    cost about what more do, so a batch chunk may hold a stage up to twice that fixed part."""
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=4, max_prefill_inflight=2, chunk_size=64,
                                  max_stall=0.2, min_chunk=16))
    for _ in range(8):
        for n in (1, 4, 16):
            s.core.prefill.observe(0, n, [0.3 + 0.01 * n])  # a stage: 0.3 s a frame, 0.01 s a position
    s.add(seq(1, BATCH, prompt_len=200))
    frames = [f.seqs[0].num_tokens for f in s.schedule()]
    assert all(25 <= n <= 30 for n in frames), frames  # (0.6 - 0.3) / 0.01 positions, not one


def test_batch_decode_frames_carry_what_fits_in_max_stall_in_turn():
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=8, max_prefill_inflight=2, chunk_size=64, max_stall=0.2))
    for i in range(1, 5):
        s.add(Seq(seq_id=i, prompt=[10], max_tokens=50, sampling=Sampling(), priority=BATCH))
    for _ in range(4):  # their prefills (the last token alone): all four join the group
        for f in s.schedule():
            s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=e.seq_id, token=7)
                                                               for e in f.seqs if e.sample]))
    assert s.decoding == 4
    s.core.prefill.observe(0, 16, [0.05 + 0.07 * 16])  # a position 0.07 s: two rows fit in 0.2 s
    turns = []
    for _ in range(2):
        (f,) = s.schedule()
        turns.append(sorted(e.seq_id for e in f.seqs))
        s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=e.seq_id, token=7) for e in f.seqs]))
    assert turns == [[1, 2], [3, 4]]
