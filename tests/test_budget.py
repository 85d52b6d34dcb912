"""The head's account of where a frame's time goes (server/cluster/budget.py), from the timings stages add."""

from __future__ import annotations

import pytest

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster import budget as budget_mod
from mlxpipe.server.cluster.budget import FrameBudget


def _decode(frame_id: int, rows: int) -> pb.Frame:
    return pb.Frame(frame_id=frame_id, kind=pb.Frame.DECODE,
                    seqs=[pb.SeqEntry(seq_id=i, num_tokens=1) for i in range(rows)])


def test_parts_wire_and_head_add_up(monkeypatch):
    clock = iter([10.0, 20.0])  # written, then handled
    monkeypatch.setattr(budget_mod.time, "perf_counter", lambda: next(clock))
    b = FrameBudget()
    b.sent(_decode(7, rows=4))
    timings = [pb.StageTiming(queued_us=100, decode_us=0, compute_us=2000, encode_us=50),
               pb.StageTiming(queued_us=200, decode_us=30, compute_us=3000, encode_us=0)]
    b.done(pb.Result(frame_id=7, timings=timings), arrived=10.01)
    t = b.kinds["decode"]
    assert (t.frames, t.tokens) == (1, 4)
    per_frame = t.mean_us("frame")
    assert per_frame["round_trip"] == pytest.approx(10_000)
    assert per_frame["compute"] == pytest.approx(5000) and per_frame["queued"] == pytest.approx(300)
    # The wire is what the stages do not account for; the head, from arrival to handled.
    assert per_frame["wire"] == pytest.approx(10_000 - 5380)
    assert per_frame["head"] == pytest.approx(20e6 - 10.01e6)
    assert t.mean_us()["compute"] == pytest.approx(1250)  # per position: 4 rows
    assert t.stage_us("frame") == [pytest.approx([100, 0, 2000, 50]), pytest.approx([200, 30, 3000, 0])]


def test_unknown_results_are_ignored_and_pending_frames_are_bounded(monkeypatch):
    b = FrameBudget()
    b.done(pb.Result(frame_id=99), arrived=0.0)  # never sent (a replaced pipeline's)
    assert b.kinds == {}
    monkeypatch.setattr(budget_mod, "MAX_PENDING", 3)
    for i in range(10):  # a broken pipeline never answers: what is remembered stays bounded
        b.sent(_decode(i, 1))
    assert len(b._pending) <= 3
    b.sent(pb.Frame(frame_id=50, kind=pb.Frame.PREFILL, seqs=[pb.SeqEntry(seq_id=1, num_tokens=16)]))
    b.done(pb.Result(frame_id=50), arrived=1e9)
    t = b.kinds["prefill"]
    assert t.tokens == 16 and t.wire == t.round_trip > 0  # no stage timings: all of it is unaccounted
    b.reset()
    assert b.kinds == {}


def test_the_idle_floor_works_between_frames_at_both_ends_and_does_not_count_it():
    """`bench overhead`'s floor with a stage's gaps: a real echo process behind the
    cluster secret; each end works between frames (the trips take that long), and the
    hop it reports leaves the work out."""
    import asyncio
    import time

    from mlxpipe.bench.overhead import EchoServer, decode_frame, ping_pong

    echo = EchoServer("a-secret", None)
    try:
        frame = decode_frame(rows=2, hidden=64, stages=2)
        hot = asyncio.run(ping_pong(echo.address, "a-secret", frame, count=20))
        work, count = 0.01, 10
        t0 = time.perf_counter()
        idle = asyncio.run(ping_pong(echo.address, "a-secret", frame, count=count, work=work))
        wall = time.perf_counter() - t0
    finally:
        echo.close()
    assert wall >= (count + 20) * 2 * work  # both ends worked before every frame of every trip
    assert 0 < hot < work and 0 < idle < work  # a hop is the wire's time, not the work's
