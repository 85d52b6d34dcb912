"""A stage's state and work, without any networking: Frames in, Frames or Results out.

``Shard`` owns the loaded layer range, every live sequence's caches and the micro-batch groups.
It runs on the one thread that owns MLX in the stage process (see ``servicer.py``); nothing here
blocks on I/O.

Sequences and caches:

- A PREFILL frame carries one chunk of one sequence. The sequence's caches
  are its own (mlx-lm ``KVCache`` per block) until it joins a decode group.
- A DECODE frame carries one token for each member of micro-batch group ``group``. The group's
  caches are batched (mlx-lm ``BatchKVCache``, left-padded, so members may have different
  lengths). Members that the head added since the group's last step are merged in; members it
  dropped are filtered out; rows follow the frame's order.
- ``free`` drops sequences wherever they are. Every frame is validated before any state changes;
  a bad frame raises ``FrameError`` and changes nothing.
- A VERIFY frame carries positions of one sequence (its last token and tokens the head drafted:
  speculative decoding). The sequence leaves its decode group for caches of its own; the last
  stage samples after every position. The head judges the drafts; a later frame's ``trim`` takes
  back the positions it rejected, before anything else: positional caches are trimmed, state
  caches (rotating windows, state-space arrays) go back to a snapshot taken before the verify
  frame, and what it accepted of that frame is computed again (``caches.Rewind``). A stage can
  take back at most ``ShardLimits.max_rewind`` positions and says so in its Load reply.
- A sequence with a grammar (``grammar.py``, last stage only) never verifies drafts; when it is
  replayed, its first frame names the tokens it generated (``generated``) and the grammar advances
  past them again.
- Prefix cache (``prefix.BlockStore``, when the head asks for one): a frame first drops the
  blocks in ``evict``; a sequence's first frame may start it after cached blocks (``reuse``); any
  later frame may name blocks of the sequence to keep (``store``), copied out before the frame's
  work, with the state at the end of the last (``snap``: the caches are exactly there). With a
  disk tier, a first frame may start from blocks read back for it (``Fetch``), which its
  ``store`` keeps in memory; ``discard`` drops blocks from disk too.
- KV quantization (``kv_quant.py``): a sequence's caches turn quantized before its first frame at
  or past its switch point (named in its first frame), after the blocks that frame keeps; in a
  decode group its row moves to a quantized part.
- An embedding request (``pool``, ``pooling.py``): the last stage pools its final hidden state.
- With the model's MTP head (``mtp_drafts.py``; last stage), a sequence whose first frame says
  ``mtp`` keeps an MTP cache beside its caches, fed the hidden states of every forward, trimmed
  with them, and drafts after a sample when a frame asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx

from mlxpipe.proto import codec
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.errors import FrameError
from mlxpipe.shards.cache import kinds
from mlxpipe.shards.cache.groups import Groups, batches
from mlxpipe.shards.cache.prefix import BlockStore, check_blocks
from mlxpipe.shards.cache.quantized import KvSwitch, quantized
from mlxpipe.shards.models.grammar import Constraint
from mlxpipe.shards.models.slicing import SlicedModel
from mlxpipe.shards.params import wire
from mlxpipe.shards.worker.clock import BusyClock, ShardView
from mlxpipe.shards.worker.errors import check_sampling, check_shape
from mlxpipe.shards.worker import answers
from mlxpipe.shards.worker.launch import Launched, later
from mlxpipe.shards.worker import images
from mlxpipe.shards.worker.mtp_drafts import Drafting, SeqDrafts, decode_rows
from mlxpipe.shards.worker.pooling import Pool
from mlxpipe.shards.worker.sampler import SeqSampler, score_prompt

@dataclass
class _Seq:
    length: int = 0                   # tokens in this stage's caches
    caches: Optional[list] = None     # own caches, while in no group
    group: Optional[int] = None       # decode group holding its caches
    sampler: Optional[SeqSampler] = None  # last stage only
    session: int = 0                  # the Forward stream that brought it
    failed: str = ""                  # last stage: why it can go no further (its grammar, its sampling)
    drafted: int = 0                  # positions VERIFY frames added since it last decoded: what may be trimmed
    rewind: Optional[kinds.Rewind] = None  # what taking drafted positions back needs (state caches)
    kv_at: int = 0                    # its caches turn quantized before a frame starting here or later (0: never)
    kv_named: bool = False            # ... as its first frame said (no frame may cross it)
    quantized: bool = False           # they did
    mtp: Optional[SeqDrafts] = None   # last stage, drafting with the model's MTP head: its MTP cache
    pool: Optional[Pool] = None       # last stage, an embedding request: its pooled hidden state (pooling.py)


@dataclass
class ShardLimits:
    max_batch: int = 32        # rows in a decode frame (the head's scheduler puts at most 32 in a group too)
    max_chunk_tokens: int = 4096  # tokens in a prefill frame
    max_context: int = 8192    # tokens per sequence
    max_seqs: int = 256        # live sequences
    max_cache_bytes: int = 0   # KV-cache bytes this stage may hold, cached prefix blocks included (0: no cap)
    block_tokens: int = 0      # positions per prefix-cache block (0: keep no prefix cache)
    max_rewind: int = 16       # drafted positions a trim may take back (state caches keep a snapshot per frame)


class Shard:
    """A stage's loaded layer range with every live sequence's caches, its decode
    groups and its prefix cache: frames in, frames (or, on the last stage, results) out."""

    def __init__(self, model: SlicedModel, hidden_size: int, vocab_size: int, limits: ShardLimits,
                 tokenizer=None, kv: KvSwitch = KvSwitch(), disk=None, drafting: Optional[Drafting] = None):
        self.model = model
        self.drafting = drafting if model.last else None  # the model's MTP head, drafting (mtp_drafts.py)
        self.tokenizer = tokenizer  # llguidance's, for grammars (last stage; None: sequences with one are refused)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.limits = limits
        self.kv = kv  # which caches turn quantized, and where (none: KV at full precision)
        self.seqs: Dict[int, _Seq] = {}
        template = model.make_cache()
        self.stateful = not all(kinds.positional(c) for c in template)  # caches that trims cannot take back
        self.groups = Groups(self.seqs, batches(template))
        self.stats = BusyClock()
        self.prefix: Optional[BlockStore] = None
        if limits.block_tokens:
            self.prefix = BlockStore(limits.block_tokens, kv.kv if kv.slots else None, disk, model.own)  # disk: or None
        self._template = template
        self.mirror = None  # a tensor-parallel group's leader: hands its state changes to its other ranks (group.py)
        self.view = ShardView()
        self.publish()

    def publish(self) -> None:
        """Make the shard's figures as they are now what ``view`` says (MLX thread only)."""
        self.view = ShardView(tuple(sorted(self.seqs)), self.cache_bytes(), self.prefix_bytes(),
                              len(self.prefix) if self.prefix is not None else 0, self.stats.view())

    # -- bookkeeping -------------------------------------------------------

    def free(self, seq_ids) -> int:
        """Drop sequences (and their rows in decode groups). Unknown ids are ignored."""
        freed = 0
        by_group: Dict[int, List[int]] = {}
        for sid in seq_ids:
            if self.prefix is not None:
                self.prefix.unstage(sid)  # blocks fetched for it that no frame took
            seq = self.seqs.pop(sid, None)
            if seq is None:
                continue
            freed += 1
            if seq.group is not None:
                by_group.setdefault(seq.group, []).append(sid)
        for gid, gone in by_group.items():
            self.groups.drop_rows(gid, gone)
        return freed

    def free_and_publish(self, seq_ids) -> int:
        if self.mirror is not None:
            self.mirror.free(seq_ids)
        freed = self.free(seq_ids)
        self.publish()
        return freed

    def free_session(self, session: int) -> int:
        """Drop every sequence a (now closed) Forward stream brought."""
        if self.mirror is not None:
            self.mirror.free_session(session)
        freed = self.free([sid for sid, seq in self.seqs.items() if seq.session == session])
        self.publish()
        return freed

    def free_all(self) -> int:
        if self.mirror is not None:
            self.mirror.free_all()
        n = len(self.seqs)
        self.seqs.clear()
        self.groups.clear()
        if self.prefix is not None:
            self.prefix.staged.clear()
        mx.clear_cache()
        self.publish()
        return n

    def cache_bytes(self) -> int:
        """KV-cache bytes of live sequences (cached prefix blocks not included)."""
        caches = self.groups.caches() + [c for s in self.seqs.values() if s.caches for c in s.caches]
        return sum(c.nbytes for c in caches)

    def starts(self) -> List[int]:
        """The prefix blocks a sequence can start after on this stage."""
        return self.prefix.starts(self._template) if self.prefix is not None else []

    def prefix_bytes(self) -> int:
        return self.prefix.nbytes if self.prefix is not None else 0

    # -- validation ----------------------------------------------------------

    def _check(self, frame: pb.Frame) -> tuple[int, int]:
        """Validate ``frame`` against this stage; return (rows, tokens per row)."""
        if (frame.evict or frame.discard) and self.prefix is None:
            raise FrameError("this stage keeps no prefix cache; the frame evicts blocks")
        rows, n = check_shape(frame, self.limits, self.model.first, self.vocab_size)
        images.check(frame, self.model, n)  # a vision model's image rows and positions
        freeing = set(frame.free)
        for e in frame.seqs:
            self._check_entry(frame, e, freeing)
        return rows, n

    def _check_entry(self, frame: pb.Frame, e: pb.SeqEntry, freeing: set) -> None:
        """Validate one sequence's entry of ``frame`` (``freeing``: the sequences it frees first)."""
        lim = self.limits
        if e.offset + e.num_tokens > lim.max_context:
            raise FrameError(
                f"sequence {e.seq_id} would reach {e.offset + e.num_tokens} tokens; "
                f"the model's context is {lim.max_context}"
            )
        seq = None if e.seq_id in freeing else self.seqs.get(e.seq_id)
        check_blocks(self.prefix, self._template, frame, e)
        if frame.kind == pb.Frame.PREFILL and (e.offset == 0 or e.reuse):
            if seq is None and len(self.seqs) - len(freeing & self.seqs.keys()) >= lim.max_seqs:
                raise FrameError(f"this stage already holds {lim.max_seqs} sequences", "RESOURCE_EXHAUSTED")
            held = self.cache_bytes() + self.prefix_bytes()
            if lim.max_cache_bytes and held >= lim.max_cache_bytes:
                raise FrameError(f"this stage's KV caches hold {held} bytes, its cap is "
                                 f"{lim.max_cache_bytes}", "RESOURCE_EXHAUSTED")
        elif seq is None:
            raise FrameError(f"unknown sequence {e.seq_id} (never prefilled here, or freed)", "NOT_FOUND")
        elif e.trim > seq.drafted:
            raise FrameError(f"sequence {e.seq_id}: only the {seq.drafted} positions verify frames added "
                             f"may be trimmed, not {e.trim}")
        elif e.trim and seq.rewind is not None and not seq.rewind.can(seq.length, e.trim):
            raise FrameError(f"sequence {e.seq_id}: this stage can take back at most "
                             f"{lim.max_rewind} positions, not {e.trim}")
        elif seq.length - e.trim != e.offset:
            raise FrameError(
                f"sequence {e.seq_id} has {seq.length} tokens here, the frame says {e.offset} "
                f"after trimming {e.trim}", "FAILED_PRECONDITION",
            )
        elif frame.kind == pb.Frame.PREFILL and seq.group is not None:
            raise FrameError(f"sequence {e.seq_id} is decoding; it cannot take a prefill chunk")
        if self.model.last and e.sampling.ByteSize():
            check_sampling(e, self.vocab_size, self.tokenizer is not None)
        if frame.kind == pb.Frame.VERIFY and self.model.last and seq.sampler.constraint is not None:
            raise FrameError(f"sequence {e.seq_id} follows a grammar: it cannot verify drafts")
        self.kv.check(e, seq)

    # -- work --------------------------------------------------------------

    def run(self, frame: pb.Frame, session: int = 0, arrived: Optional[float] = None):
        """Do one frame from Forward stream ``session`` (read off it at ``arrived``, a
        ``time.perf_counter`` reading). Returns the Frame for the next stage, or, on
        the last stage, the Result for the head; either carries this stage's timing."""
        return self.launch(frame, session, arrived).finish()

    def launch(self, frame: pb.Frame, session: int = 0, arrived: Optional[float] = None) -> Launched:
        """The first half of ``run``: check the frame, make its state changes and launch
        its graph (``mx.async_eval``); ``Launched.finish`` waits for it and builds the
        output. Another frame may be launched in between if ``Launched.independent``
        says so: its graph reads this one's cache updates, lazily."""
        started = time.perf_counter()
        rows, n = self._check(frame)
        hidden = None
        if rows and not self.model.first:  # the activations' dtype, shape and size
            try:
                hidden = codec.decode(frame.hidden, expect_shape=(rows, n, self.hidden_size))
            except codec.WireError as err:
                raise FrameError(str(err)) from err
        rows_in = images.embeds(frame, self.hidden_size) if self.model.first else None  # an image's rows
        decoded = time.perf_counter()
        if self.mirror is not None:  # accepted: the group's other ranks run it too
            self.mirror.frame(frame, session)
        # Nothing below raises FrameError: state changes start here.
        self.free(frame.free)
        if frame.evict or frame.discard:
            self.prefix.drop(frame.evict)
            self.prefix.discard(frame.discard)
        for e in frame.seqs:
            if e.trim:
                self._trim(self.seqs[e.seq_id], e.trim, e.position_shift)
        self.stats.begin()
        self.publish()
        if self.drafting is not None:
            self.drafting.begin()
        out = None  # a frame of no kind only frees and evicts
        try:
            if frame.kind == pb.Frame.PREFILL:
                out = self._prefill(frame, hidden, session, rows_in)
            elif frame.kind == pb.Frame.DECODE:
                out = self._decode(frame, hidden)
            elif frame.kind == pb.Frame.VERIFY:
                out = self._verify(frame, hidden)
        except BaseException:
            self.stats.end(rows * n)
            self.publish()
            raise
        return Launched(self, frame, out, rows * n, (arrived, started, decoded))

    def _new_seq(self, entry: pb.SeqEntry, session: int) -> _Seq:
        if entry.seq_id in self.seqs:  # replayed from the start: forget the old state
            self.free([entry.seq_id])
        seq = _Seq(caches=self.model.make_cache(), session=session, kv_at=self.kv.point(entry.kv_quantize_at),
                   kv_named=bool(entry.kv_quantize_at), pool=Pool.of(entry.pool, self.model.last))
        if entry.reuse:
            staged = self.prefix.unstage(entry.seq_id)  # read back from disk for it (Fetch)
            seq.length = self.prefix.start(entry.reuse, seq.caches, staged)
            seq.quantized = any(quantized(c) for c in seq.caches)
            self._keep_blocks(entry, seq, staged)
            self.stats.reused_tokens += seq.length
        if self.model.last:
            params = wire.sampling_from_wire(entry.sampling)
            constraint = None
            if params.grammar:
                constraint = Constraint(params.grammar, self.tokenizer, self.vocab_size, entry.generated)
            seq.sampler = SeqSampler(params, constraint)
            seq.sampler.observe(entry.context)
            if self.drafting is not None and entry.mtp:
                seq.mtp = self.drafting.start(seq.length)
        self.seqs[entry.seq_id] = seq
        return seq

    def _keep_blocks(self, entry: pb.SeqEntry, seq: _Seq, staged=None) -> None:
        """Copy the blocks the head named out of the sequence's caches (before the frame's
        work), with the state at the end of the last when it says ``snap``; or take them
        from ``staged`` (read back from disk)."""
        if not (entry.store or entry.spill):
            return
        group = self.groups[seq.group] if seq.group is not None else None
        if group is None or group.caches is None:
            caches, row = seq.caches, -1
        else:
            caches, row = group.caches, group.members.index(entry.seq_id)
        self.prefix.keep_named(entry, caches, row, staged)

    def _turn_due(self, sid: int, seq: _Seq) -> None:
        """Turn a sequence's caches quantized if this frame starts at or past its switch point."""
        if seq.kv_at and not seq.quantized and seq.length >= seq.kv_at:
            if seq.group is not None:
                self.groups.detach(seq.group, [sid])
            self.kv.turn(seq.caches)
            seq.quantized = True

    def _prefill(self, frame: pb.Frame, hidden: Optional[mx.array], session: int, rows_in: Optional[mx.array]):
        entry = frame.seqs[0]
        if entry.offset == 0 or entry.reuse:
            seq = self._new_seq(entry, session)
        else:
            seq = self.seqs[entry.seq_id]
            self._keep_blocks(entry, seq)
        self._turn_due(entry.seq_id, seq)
        self.stats.prefilled_tokens += entry.num_tokens
        tokens = mx.array(list(frame.tokens), dtype=mx.int32)[None]
        out = self.model(tokens, hidden, seq.caches, [seq.length], pooled=seq.pool is not None,
                         **images.extras(frame, rows_in, seq.length))
        seq.length += entry.num_tokens
        if not self.model.last:
            mx.async_eval(out)
            return out
        if seq.pool is not None:  # its vector once the prompt's last position is in; no sampling
            return later([kinds.arrays(seq.caches), seq.pool.add(out)], seq.pool.results(entry))
        seq.sampler.observe(frame.tokens)
        if seq.mtp is not None:
            seq.mtp.prefilled(self.drafting.rows()[0], frame.tokens, entry.sample)
        scored = score_prompt(seq.sampler, entry.seq_id, entry.offset, frame.tokens, out[0])  # if it asked
        if not entry.sample:
            return later([kinds.arrays(seq.caches), scored.arrays], scored.results)
        logits = out[:, -1, :]
        return later([logits, scored.arrays], lambda: scored.results() + answers.sample([entry], [seq], logits))

    def _trim(self, seq: _Seq, n: int, shift: int = 0) -> None:
        """Take back a sequence's last ``n`` positions (drafts the head rejected); it holds
        caches of its own while it verifies drafts."""
        if seq.rewind is None:
            for c in seq.caches:
                c.trim(n)
        else:
            def again(tokens, hidden, caches):  # accepted positions of a frame, computed again
                start = seq.length - n - len(tokens)
                mx.eval(kinds.arrays(self.model(mx.array(tokens, dtype=mx.int32)[None], hidden, caches, [start],
                                                **images.shifted(start, len(tokens), shift))))
                mx.eval(kinds.arrays(caches))

            seq.rewind.back(seq.caches, seq.length, n, again)
        seq.length -= n
        seq.drafted -= n
        if seq.sampler is not None:
            seq.sampler.trim(n)
        if seq.mtp is not None:
            seq.mtp.trim(n)

    def _verify(self, frame: pb.Frame, hidden: Optional[mx.array]):
        entry = frame.seqs[0]
        seq = self.seqs[entry.seq_id]
        if seq.group is not None:  # caches of its own, so that rejected positions can be taken back
            self.groups.detach(seq.group, [entry.seq_id])
        self._keep_blocks(entry, seq)
        self._turn_due(entry.seq_id, seq)
        if self.stateful:
            if seq.rewind is None:
                seq.rewind = kinds.Rewind(self.limits.max_rewind)
            seq.rewind.mark(seq.caches, seq.length, frame.tokens, hidden)
        out = self.model(mx.array(list(frame.tokens), dtype=mx.int32)[None], hidden, seq.caches, [seq.length],
                         **images.extras(frame, None, seq.length))
        seq.length += entry.num_tokens
        seq.drafted += entry.num_tokens
        if not self.model.last:
            mx.async_eval(out)
            return out
        if seq.mtp is not None:
            seq.mtp.add(self.drafting.rows()[0], frame.tokens)
        return later(out, lambda: answers.verify(entry, seq, out[0], list(frame.tokens)))

    def _decode(self, frame: pb.Frame, hidden: Optional[mx.array]):
        for e in frame.seqs:  # back from verifying drafts: its positions are all confirmed now
            seq = self.seqs[e.seq_id]
            seq.drafted, seq.rewind = 0, None
        for e in frame.seqs:  # (blocks are kept before any cache turns quantized)
            self._keep_blocks(e, self.seqs[e.seq_id])
            self._turn_due(e.seq_id, self.seqs[e.seq_id])
        parts = self.groups.regroup_parts(frame.group, [e.seq_id for e in frame.seqs], lambda s: self.seqs[s].quantized)
        seqs = [self.seqs[e.seq_id] for e in frame.seqs]
        lengths = [seq.length for seq in seqs]
        out = self.groups.step(self.model, parts, frame.tokens, hidden, lengths, images.decode_positions(frame, lengths))
        for seq in seqs:
            seq.length += 1
        if not self.model.last:
            mx.async_eval(out)
            return out
        if any(seq.mtp is not None for seq in seqs):  # (the rows as the parts ran them)
            rows = self.drafting.rows([i for _, part in parts for i in part])
            decode_rows(frame.seqs, [s.mtp for s in seqs], frame.tokens, rows)
        for seq, t in zip(seqs, frame.tokens):
            seq.sampler.observe([t])
        picked = [i for i, e in enumerate(frame.seqs) if e.sample]
        if not picked:
            return later(kinds.arrays([g.caches or g.rows_of(self.seqs) for g, _ in parts]), list)
        logits = out[:, -1, :]
        if len(picked) < len(seqs):
            logits = logits[mx.array(picked)]
        entries, rows = [frame.seqs[i] for i in picked], [seqs[i] for i in picked]
        return later(logits, lambda: answers.sample(entries, rows, logits))
