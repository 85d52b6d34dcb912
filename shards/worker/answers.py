"""What the last stage answers for the rows it samples: each row's pick as a ``TokenResult``,
with the drafts the model's MTP head makes after it where the frame asks (``SeqEntry.mtp``),
or why its sequence can go no further (its own sampling or grammar failed: only it ends).

A decode step and a prefill's last chunk pick one token per row (``sample``); a VERIFY frame
picks after each of its positions (``verify``), each exactly as a decode step there would.
"""

from __future__ import annotations

import logging
from typing import List, Sequence

import mlx.core as mx

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.worker.mtp_drafts import accepted
from mlxpipe.shards.worker.sampler import SequenceFailure, pick_batch, pick_positions, token_result

logger = logging.getLogger(__name__)


def sample(entries: Sequence[pb.SeqEntry], seqs: list, logits: mx.array) -> List[pb.TokenResult]:
    """One pick per row of ``logits`` (``seqs``: the stage's sequences, each past its row's
    position); a row whose own sampling or grammar fails gets an error result instead, and its
    sequence goes no further (the head ends it alone)."""
    rows = [i for i, s in enumerate(seqs) if not s.failed]
    picks = {}
    if rows:
        logits = logits if len(rows) == len(seqs) else logits[mx.array(rows)]
        got = pick_batch([seqs[i].sampler for i in rows], logits, [seqs[i].length for i in rows])
        picks = dict(zip(rows, got))
    out = []
    for i, (e, s) in enumerate(zip(entries, seqs)):
        pick = picks.get(i)
        if isinstance(pick, SequenceFailure):
            s.failed = str(pick)
            logger.info("sequence %d failed here: %s", e.seq_id, s.failed)
        if s.failed:
            out.append(pb.TokenResult(seq_id=e.seq_id, error=s.failed))
        else:
            out.append(token_result(e.seq_id, pick, s.sampler.finished))
            if s.mtp is not None and e.mtp:
                out[-1].drafts.extend(s.mtp.draft(s.length - 1, pick[0], e.mtp))
    return out


def verify(entry: pb.SeqEntry, seq, logits: mx.array, tokens: List[int]) -> List[pb.TokenResult]:
    """A pick after every position of a VERIFY frame (``logits`` [n, V] for ``tokens``), and the
    MTP head's drafts after the last one the head will take."""
    start = seq.length - entry.num_tokens
    picks = pick_positions(seq.sampler, logits, tokens, start)
    failed = next((p for p in picks if isinstance(p, SequenceFailure)), None)
    if failed is not None or seq.failed:
        seq.failed = seq.failed or str(failed)
        return [pb.TokenResult(seq_id=entry.seq_id, error=seq.failed)]
    out = [token_result(entry.seq_id, pick) for pick in picks]
    if seq.mtp is not None and entry.mtp:
        a = accepted(tokens, [p[0] for p in picks])
        out[a - 1].drafts.extend(seq.mtp.draft(start + a - 1, picks[a - 1][0], entry.mtp))
    return out
