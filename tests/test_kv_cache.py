"""Quantized KV caches: the batched one against mlx-lm's single-sequence ``QuantizedKVCache``
and ``BatchKVCache``, the switch point against mlx-lm's ``generate_step``, and what the
head makes of them (chunks, speculation, the KV budget, prefix-cache keys). No processes."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.errors import FrameError
from mlxpipe.server.core.kv_budget import KvBudget
from mlxpipe.server.core.plan import Sample
from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.cache.quantized import BatchQuantizedKVCache, KvSwitch, merge
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.kv import (DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START, PREFILL_STEP, KvQuant,
                                     quantize_at)
from mlxpipe.shards.params.quant import kv_bytes
from mlxpipe.shards.params.sampling import Sampling

H, D = 2, 64  # KV heads, head dimension


def _kv(n: int, seed: int):
    mx.random.seed(seed)
    return mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))


def _single(lengths_and_seeds, bits=4, chunk=3):
    """One QuantizedKVCache per sequence, filled a few positions at a time (as a stage's calls do)."""
    out = []
    for n, seed in lengths_and_seeds:
        k, v = _kv(n, seed)
        c = QuantizedKVCache(group_size=64, bits=bits)
        for a in range(0, n, chunk):
            c.update_and_fetch(k[:, :, a : a + chunk], v[:, :, a : a + chunk])
        out.append(c)
    return out


def _data(c: QuantizedKVCache):
    """A single cache's keys and values, positions [0, offset)."""
    return [x[..., : c.offset, :] for t in (c.keys, c.values) for x in t]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_each_position_quantizes_on_its_own():
    """mlx-lm quantizes a cache turned quantized late (``to_quantized``) and one written
    quantized from the start alike: group-wise along the head dimension is per position."""
    k, v = _kv(37, 0)
    late = KVCache()
    late.update_and_fetch(k[:, :, :20], v[:, :, :20])
    late = late.to_quantized(group_size=64, bits=4)
    late.update_and_fetch(k[:, :, 20:], v[:, :, 20:])
    (early,) = _single([(37, 0)])
    assert _same(_data(late), _data(early))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_of_a_batch_quantizes_as_the_sequence_alone(bits):
    """Rows of different lengths merged, then decoding together: every row holds exactly
    the bits its sequence alone holds (packed values, scales and biases)."""
    seqs = [(5, 1), (17, 2), (9, 3)]
    batch = merge(_single(seqs, bits))
    assert isinstance(batch, BatchQuantizedKVCache) and batch.left_padding.tolist() == [12, 0, 8]
    alone = _single(seqs, bits)
    for step in range(3):  # decode steps: one new position per row, written together
        new = [_kv(1, 100 + 10 * step + i) for i in range(3)]
        batch.update_and_fetch(mx.concatenate([k for k, _ in new]), mx.concatenate([v for _, v in new]))
        for c, (k, v) in zip(alone, new):
            c.update_and_fetch(k, v)
    for i, c in enumerate(alone):
        assert _same(_data(batch.extract(i)), _data(c)), f"row {i} differs from its sequence alone"
    assert batch.offset.tolist() == [8, 20, 12] and batch.size() == 20


def test_batched_bookkeeping_follows_batch_kv_cache():
    """filter, extend, trim and make_mask leave padding, offsets and masks as BatchKVCache's
    do, and the quantized keys are the full-precision ones' quantized."""
    seqs = [(5, 1), (17, 2), (9, 3), (2, 4)]
    full = []
    for n, seed in seqs:
        c = KVCache()
        c.update_and_fetch(*_kv(n, seed))
        full.append(c)
    q, b = merge(_single(seqs[:2])), BatchKVCache.merge(full[:2])
    q.extend(merge(_single(seqs[2:])))
    b.extend(BatchKVCache.merge(full[2:]))
    for step in ("extend", "filter", "trim"):
        if step == "filter":
            q.filter(mx.array([2, 0, 3]))
            b.filter(mx.array([2, 0, 3]))
        elif step == "trim":
            assert q.trim(2) == b.trim(2) == 2
        for attr in ("left_padding", "offset"):
            assert getattr(q, attr).tolist() == getattr(b, attr).tolist(), (step, attr)
        assert q._idx == b._idx
        assert mx.array_equal(q.make_mask(3), b.make_mask(3)).item()
        for row, pad in enumerate(q.left_padding.tolist()):
            want = mx.quantize(b.keys[row : row + 1, :, pad : b._idx], group_size=64, bits=4)
            got = [x[row : row + 1, :, pad : q._idx] for x in q.keys]
            assert _same(got, want), (step, row)


def test_batched_attention_reads_each_row_as_its_own_cache():
    """mlx-lm's quantized attention over a batch (left padding masked) gives each row what
    the row's own cache gives, to float rounding."""
    seqs = [(6, 1), (11, 2)]
    batch, alone = merge(_single(seqs)), _single(seqs)
    mx.random.seed(9)
    queries = mx.random.normal((2, H, 1, D))
    mask = batch.make_mask(1)  # (as a model makes it: before its layers write the new position)
    qk, qv = batch.update_and_fetch(*(mx.concatenate(x) for x in zip(*(_kv(1, 50 + i) for i in range(2)))))
    out = quantized_scaled_dot_product_attention(mx.array(queries), qk, qv, 0.125, mask, 64, 4)  # (it scales in place)
    for i, c in enumerate(alone):
        k1, v1 = c.update_and_fetch(*_kv(1, 50 + i))
        one = quantized_scaled_dot_product_attention(mx.array(queries[i : i + 1]), k1, v1, 0.125, None, 64, 4)
        assert mx.allclose(out[i : i + 1], one, atol=1e-5).item()


def test_the_planners_kv_bytes_are_what_a_quantized_cache_holds():
    values = 2 * H * 256 * D
    for bits in (8, 4):
        for dtype in (mx.float16, mx.float32):
            c = QuantizedKVCache(group_size=64, bits=bits)
            c.update_and_fetch(*(x.astype(dtype) for x in _kv(256, 0)))
            assert c.nbytes == kv_bytes(values, bits, 64, dtype.size)
    assert kv_bytes(values, 4, 64, 2) / kv_bytes(values, 16, 64, 2) < 0.3  # bf16/fp16 models: 4-bit KV under 0.3x


class _Counter(nn.Module):
    """A model that only advances its caches (keys of zeros): where mlx-lm switches them."""

    def __init__(self):
        super().__init__()
        self.switched = None

    def make_cache(self):
        model = self

        class Watched(KVCache):
            def to_quantized(self, group_size=64, bits=4):
                model.switched = self.offset
                return super().to_quantized(group_size, bits)

        return [Watched()]

    def __call__(self, inputs, cache=None, **kw):
        n = inputs.shape[1]
        cache[0].update_and_fetch(mx.zeros((1, 1, n, 64)), mx.zeros((1, 1, n, 64)))
        return mx.zeros((1, n, 8))


@pytest.mark.parametrize("start, prompt_len", [(5000, 1), (5000, 100), (5000, 4999), (5000, 5000), (5000, 5001),
                                               (5000, 5002), (5000, 6145), (5000, 6146), (5000, 9000), (0, 1),
                                               (0, 2), (0, 40), (0, 2049), (0, 2050), (2048, 2049), (2048, 2050),
                                               (40, 30), (40, 41), (40, 42)])
def test_switch_point_is_mlx_lms(start, prompt_len):
    """``quantize_at`` is where mlx-lm's generate_step turns a prompt's cache quantized."""
    from mlx_lm.generate import generate_step

    model = _Counter()
    steps = max(start - prompt_len, 0) + 2
    for _ in generate_step(mx.zeros((prompt_len,), dtype=mx.int32), model, max_tokens=steps, kv_bits=4,
                           quantized_kv_start=start):
        if model.switched is not None:
            break
    assert model.switched == quantize_at(prompt_len, start)


def test_defaults_are_mlx_lms():
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START as mlx_lms, generate_step

    params = inspect.signature(generate_step).parameters
    assert DEFAULT_QUANTIZED_KV_START == mlx_lms
    assert params["kv_group_size"].default == DEFAULT_KV_GROUP_SIZE
    assert params["prefill_step_size"].default == PREFILL_STEP


def test_bad_settings_are_refused():
    for bits, group, start in ((3, 64, 0), (8, 48, 0), (4, 64, -1)):
        with pytest.raises(ValueError):
            KvQuant(bits, group, start)
    assert KvQuant.of(None) is None and KvQuant.of(16) is None and wire.kv_from_wire(pb.KvQuantization()) is None


def test_stage_refuses_frames_across_the_switch():
    switch = KvSwitch(KvQuant(4, 64, 40), (0,))
    first = pb.SeqEntry(seq_id=1, offset=0, num_tokens=41, kv_quantize_at=40)
    with pytest.raises(FrameError, match="cross 40"):
        switch.check(first)
    switch.check(pb.SeqEntry(seq_id=1, offset=0, num_tokens=40, kv_quantize_at=40))

    class Held:
        kv_at, kv_named, quantized, length = 40, True, True, 44

    with pytest.raises(FrameError, match="cannot be taken back"):
        switch.check(pb.SeqEntry(seq_id=1, offset=39, num_tokens=1, trim=5), Held())
    switch.check(pb.SeqEntry(seq_id=1, offset=40, num_tokens=1, trim=4), Held())
    assert KvSwitch().point(40) == 0 and switch.point(0) == 40 and switch.point(7) == 7


# -- the head ---------------------------------------------------------------------------


def _scheduler(**kw) -> Scheduler:
    s = Scheduler(SchedulerConfig(chunk_size=16, num_groups=1, max_prefill_inflight=8, kv_start=40, **kw))
    s.set_kv(True, 4.0)
    return s


def test_prefill_chunks_end_at_the_switch():
    """A 3000-token prompt with start 40 switches at 2048 (mlx-lm's first prefill call
    that reaches 40): no chunk crosses it, and the first step names it."""
    s = _scheduler()
    s.config.max_prefill_inflight, s.config.chunk_size, s.config.min_chunk = 64, 500, 500
    s.add(Seq(seq_id=1, prompt=list(range(3000)), max_tokens=4, sampling=Sampling()))
    spans = [(st.entries[0].offset, st.entries[0].offset + st.entries[0].num_tokens) for st in s.schedule()]
    assert spans[-1] == (2999, 3000) and all(a == b for (_, a), (b, _) in zip(spans, spans[1:]))
    assert (2048 in [e for _, e in spans]) and not any(a < 2048 < e for a, e in spans)
    assert s.schedule() == [] and len(spans) > 3


def test_budget_counts_full_precision_positions_before_the_switch():
    kv = KvBudget(10_000, 16, 0)
    kv.set_kv(100, 4.0)
    short = Seq(seq_id=1, prompt=[1] * 30, max_tokens=20, sampling=Sampling())  # switches at 100: never
    mid = Seq(seq_id=2, prompt=[1] * 300, max_tokens=700, sampling=Sampling())  # at 299
    long = Seq(seq_id=3, prompt=[1] * 300, max_tokens=2000, sampling=Sampling())
    assert kv.need(short) == 50 * 4 and short.kv_at == 100
    assert kv.need(mid) == 299 * 4 and mid.kv_at == 299  # its peak: 299 positions at full precision
    assert kv.need(long) == 2300  # its peak: all of them, quantized
    kv.set_kv(None, 4.0)
    assert kv.need(Seq(seq_id=3, prompt=[1] * 30, max_tokens=20, sampling=Sampling())) == 50


def test_the_served_context_counts_positions_before_the_switch_at_full_precision():
    kv = KvBudget(10_000, 16, 0)
    assert kv.longest() == 10_000
    kv.set_kv(100, 4.0)  # every switch point lies at or before 2048 (quantize_at): 8,192 of 10,000 positions
    assert kv.longest() == 10_000
    for n in range(1, 10_001, 37):  # the longest holds however the request splits into prompt and reply
        assert kv.need(Seq(seq_id=n, prompt=[1] * n, max_tokens=10_000 - n, sampling=Sampling())) <= 10_000
    kv.resize(4_000)  # 2048 positions at full precision would cost 8,192: the context is what fits before the switch
    assert kv.longest() == 1_000
    assert all(kv.need(Seq(seq_id=n, prompt=[1] * n, max_tokens=1_000 - n, sampling=Sampling())) <= 4_000
               for n in range(1, 1_000, 7))
    assert kv.need(Seq(seq_id=9, prompt=[1] * 1_100, max_tokens=1, sampling=Sampling())) > 4_000  # a longer may not


def test_blocks_past_the_switch_are_keyed_with_it():
    """Blocks that end before a sequence's switch point hold full-precision keys and are
    shared; later ones only with sequences that switch at the same point; and each costs
    what its form costs."""
    kv = KvBudget(10_000, 16, 100)
    kv.reset_prefix([[], []], 100)
    kv.set_kv(40, 4.0)
    a = Seq(seq_id=1, prompt=list(range(80)), max_tokens=20, sampling=Sampling())
    b = Seq(seq_id=2, prompt=list(range(90)), max_tokens=4, sampling=Sampling())
    for s in (a, b):
        kv.place(s)
        s.feed = list(s.prompt)
    assert (a.kv_at, b.kv_at) == (79, 89)
    kv.set_room(0)
    a.generated = list(range(80, 90))  # it decodes past block 4's end
    first, keys, _, spill = kv.store(a, 90)
    assert first == 0 and len(keys) == 5 and spill == []  # (no disk tier: nothing to spill)
    assert kv.prefix.tokens == 4 * 64 + 16  # blocks ending at or before 79 at full precision, one quantized
    assert kv.cached_prefix(b) == keys[:4], "b switches at 89: a's block [64, 80) held quantized keys"
    again = Seq(seq_id=3, prompt=a.prompt, max_tokens=20, sampling=Sampling(), generated=a.generated)
    kv.place(again)  # a replayed: its prompt and what it generated
    again.feed = again.prompt + again.generated
    assert kv.cached_prefix(again) == keys


class _Guess:
    """A drafter that always guesses token 7."""

    source = "prompt_lookup"

    def prepare(self, tokens):
        pass

    def propose(self, tokens, k, confirmed):
        return [7] * k

    def close(self):
        pass


def test_speculation_stays_short_of_the_switch_until_it_is_confirmed():
    """Drafts in flight end at the switch point while it is not confirmed: no VERIFY step
    crosses it, and no trim could take back positions before it once caches switched."""
    from mlxpipe.server.core.budget import KindTotals
    from mlxpipe.server.core.sequence import Phase
    from mlxpipe.server.core.speculation import Speculator

    cfg = SchedulerConfig(speculate=True, spec_positions=2, spec_depth=8, spec_frames=8)
    sp = Speculator(cfg, drafters=lambda seq: _Guess(), costs=lambda: {"decode": KindTotals(frame_s=1.0)})
    seq = Seq(seq_id=1, prompt=[1] * 30, max_tokens=50, sampling=Sampling(), phase=Phase.RUNNING, generated=[5])
    seq.kv_at = 34  # the stages hold 30 confirmed positions
    assert sp.leaves_group(seq, live=1)
    _, verifies = sp.wants({1: seq}, live=1)
    spans = [(v.offset, v.offset + len(v.tokens)) for v in verifies]
    assert spans == [(30, 32), (32, 34)]
    seq.generated += [7] * 4  # all confirmed: 34 positions now, past the switch
    sp.judge(seq, 0, [Sample(1, 7) for _ in range(2)])
    sp.judge(seq, 0, [Sample(1, 7) for _ in range(2)])
    _, verifies = sp.wants({1: seq}, live=1)
    spans = [(v.offset, v.offset + len(v.tokens)) for v in verifies]
    assert spans[0][0] == 34 and spans[-1][1] == 34 + 9  # its whole depth (8 drafts and the last token) again


def test_prefix_blocks_are_kept_and_filled_back_quantized():
    """Blocks kept before a sequence switched hold full-precision keys, later ones quantized
    ones (from its own cache, or its row of a batch); a sequence that starts after both
    gets a quantized cache holding exactly what the writer held, one after the first only
    a full-precision one."""
    from mlxpipe.shards.cache.prefix import BlockStore

    kv = KvQuant(4, 64, 32)
    store = BlockStore(16, kv)
    k, v = _kv(70, 7)
    full = KVCache()
    full.update_and_fetch(k[:, :, :32], v[:, :, :32])
    store.keep(1, [full], 0)
    store.keep(2, [full], 1)
    switched = full.to_quantized(group_size=64, bits=4)  # the writer switches at 32
    switched.update_and_fetch(k[:, :, 32:], v[:, :, 32:])
    store.keep(3, [switched], 2)
    other = _single([(20, 8)])[0]  # a second row: the writer decodes in a batch
    batch = merge([other, switched])
    store.keep(4, [batch], 3, row=1)
    caches = [KVCache()]
    assert store.start([1, 2, 3, 4], caches) == 64
    assert isinstance(caches[0], QuantizedKVCache) and caches[0].offset == 64
    assert _same(_data(caches[0]), [x[..., :64, :] for t in (switched.keys, switched.values) for x in t])
    caches = [KVCache()]
    assert store.start([1, 2], caches) == 32 and type(caches[0]) is KVCache
    assert mx.array_equal(caches[0].keys, k[:, :, :32]).item() and caches[0].offset == 32
