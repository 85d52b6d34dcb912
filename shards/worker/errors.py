"""The checks of a frame that need no state (what a refusal is: ``proto/errors.py``)."""

from __future__ import annotations

from typing import Tuple

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.errors import FrameError
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.sampling import SamplingError

MAX_TIMINGS = 256  # stage timings a frame may carry (one per stage it passed)


def check_shape(frame: pb.Frame, limits, first: bool, vocab_size: int) -> Tuple[int, int]:
    """Validate what a frame is, apart from the sequences a stage holds: its kind, rows,
    tokens and activations against ``limits`` (``ShardLimits``), on the first stage or
    a later one; return (rows, tokens per row)."""
    if len(frame.timings) > MAX_TIMINGS:
        raise FrameError(f"a frame carries the timings of at most {MAX_TIMINGS} stages, not {len(frame.timings)}")
    if frame.kind == pb.Frame.CONTROL:
        if frame.seqs or frame.tokens or frame.HasField("hidden"):
            raise FrameError("a CONTROL frame carries only `free` and `evict`")
        return 0, 0
    rows = len(frame.seqs)
    if rows == 0:
        raise FrameError("frame has no sequences")
    if frame.kind in (pb.Frame.PREFILL, pb.Frame.VERIFY):  # one sequence, several positions
        kind = pb.Frame.Kind.Name(frame.kind)
        if rows != 1:
            raise FrameError(f"a {kind} frame carries one sequence, got {rows}")
        n = frame.seqs[0].num_tokens
        if not 1 <= n <= limits.max_chunk_tokens:
            what = "prefill chunk of {} tokens" if frame.kind == pb.Frame.PREFILL else "verify frame of {} positions"
            raise FrameError(f"{what.format(n)}; this stage takes 1..{limits.max_chunk_tokens}")
    elif frame.kind == pb.Frame.DECODE:
        if rows > limits.max_batch:
            raise FrameError(f"decode frame of {rows} rows; this stage takes at most {limits.max_batch}")
        if any(e.num_tokens != 1 for e in frame.seqs):
            raise FrameError("every row of a DECODE frame adds exactly one token")
        n = 1
    else:
        raise FrameError(f"unknown frame kind {frame.kind}")
    if len(frame.tokens) != rows * n:
        raise FrameError(f"frame has {len(frame.tokens)} token ids for {rows} x {n} positions")
    if first:
        if frame.HasField("hidden"):
            raise FrameError("the first stage takes token ids, not activations")
        bad = [t for t in frame.tokens if not 0 <= t < vocab_size]
        if bad:
            raise FrameError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    elif not frame.HasField("hidden"):
        raise FrameError("a frame into a later stage must carry activations")
    ids = [e.seq_id for e in frame.seqs]
    if len(set(ids)) != rows:
        raise FrameError("a sequence appears twice in one frame")
    return rows, n


def check_sampling(e: pb.SeqEntry, vocab_size: int, has_tokenizer: bool) -> None:
    """Validate a sequence's sampling parameters on the last stage (``has_tokenizer``: it
    can follow grammars)."""
    try:
        wire.sampling_from_wire(e.sampling).validate(vocab_size)
    except SamplingError as err:
        raise FrameError(f"sequence {e.seq_id}: {err}") from err
    if e.sampling.grammar and not has_tokenizer:
        raise FrameError(f"sequence {e.seq_id} has a grammar, and this stage was loaded without a tokenizer",
                         "FAILED_PRECONDITION")
    # A grammar that does not compile is this sequence's failure, not the frame's:
    # it is compiled off this thread and fails the sequence alone (``Constraint``).
