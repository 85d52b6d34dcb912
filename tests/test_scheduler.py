"""The scheduler is pure logic: these tests drive it with hand-made results."""

from __future__ import annotations

import pytest
from inproc import WiredScheduler as Scheduler  # (the scheduler's steps as frames)

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Phase, QueueFull, Seq
from mlxpipe.shards.params.sampling import Sampling


def seq(i, prompt_len=5, max_tokens=4, eos=()):
    return Seq(seq_id=i, prompt=list(range(10, 10 + prompt_len)), max_tokens=max_tokens,
                    sampling=Sampling(), eos=frozenset(eos))


def result(frame, token=7, seconds=()):
    """What the last stage would answer for `frame`: a token for every sampling row (and, with
    ``seconds``, each stage's time on it)."""
    return pb.Result(frame_id=frame.frame_id,
                     tokens=[pb.TokenResult(seq_id=e.seq_id, token=token) for e in frame.seqs if e.sample],
                     timings=[pb.StageTiming(compute_us=int(x * 1e6)) for x in seconds])


def test_prefill_is_chunked_and_the_last_token_goes_alone():
    s = Scheduler(SchedulerConfig(chunk_size=4, max_prefill_inflight=10))
    s.add(seq(1, prompt_len=11))
    frames = s.schedule()
    # 10 body tokens in chunks of 4, then the last token alone, sampled.
    assert [(f.seqs[0].offset, f.seqs[0].num_tokens, f.seqs[0].sample) for f in frames] == [
        (0, 4, False), (4, 4, False), (8, 2, False), (10, 1, True)]
    assert [t for f in frames for t in f.tokens] == list(range(10, 21))
    assert frames[0].seqs[0].HasField("sampling") and not frames[1].seqs[0].HasField("sampling")


def test_prefill_chunks_shrink_to_the_stall_bound_while_others_decode():
    """Sarathi's stall-free batching: with a sequence decoding, a prompt's chunks hold
    the slowest stage no longer than ``max_stall`` at the cost its frames measured
    (``prefill.py``); before any prefill frame is timed it goes in full chunks."""
    s = Scheduler(SchedulerConfig(chunk_size=64, min_chunk=1, max_prefill_inflight=1, max_stall=0.25))
    s.add(seq(1, prompt_len=1))  # min_chunk 1: the bound alone (it never cuts under min_chunk)
    (first,) = s.schedule()
    s.on_result(result(first))
    assert s.decoding == 1
    s.add(seq(2, prompt_len=200))
    frames = s.schedule()
    prefill = [f for f in frames if f.kind == pb.Frame.PREFILL]
    assert prefill[0].seqs[0].num_tokens == 64  # no cost measured yet
    s.on_result(result(prefill[0], seconds=(0.5, 64 * 0.04)))  # the slowest stage: 0.04 s a position
    (nxt,) = [f for f in s.schedule() if f.kind == pb.Frame.PREFILL]
    assert nxt.seqs[0].num_tokens == 6  # 0.25 s / 0.04 s per position
    s.on_result(result(nxt, seconds=(0.5, 6.0)))  # a stage far slower now
    (slow,) = [f for f in s.schedule() if f.kind == pb.Frame.PREFILL]
    assert slow.seqs[0].num_tokens == 1  # never nothing


def test_prefill_frames_in_flight_are_bounded():
    s = Scheduler(SchedulerConfig(chunk_size=2, max_prefill_inflight=2))
    s.add(seq(1, prompt_len=9))
    first = s.schedule()
    assert len(first) == 2 and s.schedule() == []
    s.on_result(result(first[0]))
    (third,) = s.schedule()
    assert third.seqs[0].offset == 4


def test_sequences_join_the_smallest_group_and_decode_in_groups():
    s = Scheduler(SchedulerConfig(num_groups=2, max_prefill_inflight=10))
    for i in range(1, 4):
        s.add(seq(i, prompt_len=1))
    prefills = s.schedule()
    for f in prefills:
        assert s.on_result(result(f))[0].seq.phase == Phase.RUNNING
    assert s.groups == [[1, 3], [2]]
    decodes = s.schedule()
    assert [(f.kind, f.group, [e.seq_id for e in f.seqs]) for f in decodes] == [
        (pb.Frame.DECODE, 0, [1, 3]), (pb.Frame.DECODE, 1, [2])]
    # One frame per group in flight: nothing more until a result comes back.
    assert s.schedule() == []
    # The decode input is the last token; the offset is what the caches hold.
    assert list(decodes[0].tokens) == [7, 7] and decodes[0].seqs[0].offset == 1
    s.on_result(result(decodes[1]))
    (again,) = s.schedule()
    assert again.group == 1 and again.seqs[0].offset == 2


def test_finished_and_cancelled_sequences_are_freed_on_the_next_frame():
    s = Scheduler(SchedulerConfig(num_groups=1, max_prefill_inflight=10))
    s.add(seq(1, prompt_len=1, max_tokens=2))
    s.add(seq(2, prompt_len=1, max_tokens=10))
    for f in s.schedule():
        s.on_result(result(f))
    (step,) = s.schedule()
    events = s.on_result(result(step))
    assert [(e.seq.seq_id, e.finished, e.seq.finish_reason) for e in events] == [(1, True, "length"), (2, False, None)]
    (nxt,) = s.schedule()
    assert list(nxt.free) == [1] and [e.seq_id for e in nxt.seqs] == [2]
    s.cancel(2)
    # The in-flight frame's result for a cancelled sequence is dropped.
    assert s.on_result(result(nxt)) == []
    (control,) = s.schedule()
    assert control.kind == pb.Frame.CONTROL and list(control.free) == [2]
    s.on_result(result(control))
    assert s.idle


def test_eos_stops_with_reason_stop():
    s = Scheduler(SchedulerConfig(max_prefill_inflight=10))
    s.add(seq(1, prompt_len=1, eos={7}))
    (f,) = s.schedule()
    (ev,) = s.on_result(result(f, token=7))
    assert ev.finished and ev.seq.finish_reason == "stop"


def test_waiting_queue_is_bounded_and_admission_is_fifo():
    s = Scheduler(SchedulerConfig(num_groups=1, max_batch=2, max_running=2, max_waiting=2,
                                  max_prefill_inflight=10))
    s.add(seq(1, prompt_len=1))
    s.add(seq(2, prompt_len=1))
    frames = s.schedule()
    assert [f.seqs[0].seq_id for f in frames] == [1, 2]
    s.add(seq(3, prompt_len=1))
    s.add(seq(4, prompt_len=1))
    assert s.schedule() == []  # only max_running sequences hold caches
    with pytest.raises(QueueFull):
        s.add(seq(5))
    for f in frames:
        s.on_result(result(f))
    s.cancel(1)
    frames = s.schedule()
    assert [f.seqs[0].seq_id for f in frames if f.kind == pb.Frame.PREFILL] == [3]


def test_replay_restarts_live_sequences_from_prompt_plus_generated():
    s = Scheduler(SchedulerConfig(num_groups=1, chunk_size=100, max_prefill_inflight=10))
    s.add(seq(1, prompt_len=3, max_tokens=10))
    body, last = s.schedule()
    s.on_result(result(body))
    s.on_result(result(last, token=50))
    (d,) = s.schedule()
    s.on_result(result(d, token=51))
    s.schedule()  # a decode frame is in flight when the pipeline breaks
    s.replay_all()
    body, last = s.schedule()
    assert list(body.tokens) == [10, 11, 12, 50] and body.seqs[0].offset == 0
    assert list(last.tokens) == [51] and last.seqs[0].sample and last.seqs[0].offset == 4
    (ev,) = s.on_result(result(last, token=52))
    assert ev.seq.generated == [50, 51, 52] and ev.seq.cached == 5


def test_config_must_fit_running_sequences_in_groups():
    with pytest.raises(ValueError, match="exceeds"):
        Scheduler(SchedulerConfig(num_groups=2, max_batch=4, max_running=9))


def test_short_prompts_prefill_first_and_groups_alternate():
    s = Scheduler(SchedulerConfig(num_groups=2, chunk_size=4, max_prefill_inflight=1))
    s.add(seq(1, prompt_len=13))  # a long prompt first
    for i in range(2, 5):
        s.add(seq(i, prompt_len=2))
    order = []
    steps = {0: 0, 1: 0}
    for _ in range(40):
        for f in s.schedule():
            if f.kind == pb.Frame.PREFILL:
                order.append(f.seqs[0].seq_id)
            elif f.kind == pb.Frame.DECODE:
                steps[f.group] += 1
            s.on_result(result(f))
    # Every prompt prefilled: the short ones first, in the order they arrived, then the long one.
    assert [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k] == [2, 3, 4, 1]
    # Both groups decode; neither waits for the other to finish.
    assert steps[0] > 0 and steps[1] > 0


def test_a_new_sequence_joins_at_its_groups_next_step():
    s = Scheduler(SchedulerConfig(num_groups=1, max_prefill_inflight=10))
    s.add(seq(1, prompt_len=1, max_tokens=10))
    (p1,) = s.schedule()
    s.on_result(result(p1))
    (d1,) = s.schedule()  # group 0 steps with sequence 1 alone
    s.add(seq(2, prompt_len=1, max_tokens=10))
    (p2,) = s.schedule()
    s.on_result(result(p2))  # 2 is ready while group 0's frame is in flight
    assert s.schedule() == []
    s.on_result(result(d1))
    (d2,) = s.schedule()
    assert [e.seq_id for e in d2.seqs] == [1, 2]


def test_kv_budget_caps_admission_in_arrival_order():
    # Each sequence reserves prompt (5) + budget (4) = 9 KV positions; room for 20.
    s = Scheduler(SchedulerConfig(max_kv_tokens=20, max_prefill_inflight=10))
    for i in range(1, 5):
        s.add(seq(i))
    assert {f.seqs[0].seq_id for f in s.schedule()} == {1, 2}
    assert s.kv_reserved == 18
    s.cancel(1)
    assert {f.seqs[0].seq_id for f in s.schedule() if f.kind == pb.Frame.PREFILL} == {3}
