"""The prefix cache's disk tier: block files (any tree of arrays, checked), one stage's
tier (bounded, faults contained, one writer per directory, ranges that shrink), the
head's index of both tiers, and greedy equality with mlx-lm when prompts start from
blocks read back from disk after a restart, a corrupted file or a re-plan (in one
process: ``inproc.py``). ``test_disk_restart.py`` does it with real processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from inproc import InProcess, WiredScheduler as Scheduler
from mlx_lm.models.cache import RotatingKVCache

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.prefix_index import PrefixIndex, chain_hashes
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.cache import disk as disk_cache
from mlxpipe.shards.cache.block_file import decode, encode
from mlxpipe.shards.cache.disk import DiskTier
from mlxpipe.shards.models.digest import WeightsDigest
from mlxpipe.shards.worker.disk_service import DiskService
from mlxpipe.shards.worker.sampler import Sampling

B = 4  # block tokens in the pure tests


def _block(value: float, n: int = 64):
    a = mx.full((1, 2, B, n), value)
    mx.eval(a)
    return {"kv": {0: (a, a)}, "state": None}


def _files(tier: DiskTier):
    return sorted(tier.dir.glob("*.safetensors"))


# -- files ---------------------------------------------------------------------------


def test_a_block_file_holds_any_tree_of_arrays_as_it_is(tmp_path):
    window = RotatingKVCache(max_size=8)
    window.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    quantized = mx.quantize(mx.random.normal((2, 64)), group_size=32, bits=4)  # (data, scales, biases)
    keys = mx.random.normal((1, 2, B, 8)).astype(mx.bfloat16)
    tree = {"kv": {3: (keys, keys * 2), 5: None, 7: [quantized, tuple(quantized)]},
            "state": {5: {"offset": 3, "cache": window, "ratio": 0.5, "name": "w", "on": True}}}
    mx.eval(keys, quantized, window.keys, window.values)
    chunks, size = encode(tree, {"key": "0"})
    data = b"".join(bytes(c) for c in chunks)
    assert len(data) == size
    back, meta = decode(data)
    assert meta["key"] == "0"
    assert back["kv"][5] is None and type(back["kv"][7][0]) is type(quantized) and type(back["kv"][7][1]) is tuple
    assert back["kv"][3][0].dtype == mx.bfloat16 and mx.array_equal(back["kv"][3][1], keys * 2).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(back["kv"][7][0], quantized))
    restored = back["state"][5]["cache"]
    assert type(restored) is RotatingKVCache and restored.offset == 3 and restored.max_size == 8
    assert mx.array_equal(restored.keys, window.keys).item()
    assert {k: v for k, v in back["state"][5].items() if k != "cache"} == {"offset": 3, "ratio": 0.5, "name": "w",
                                                                            "on": True}
    (tmp_path / "b.safetensors").write_bytes(data)  # a plain safetensors file: mx.load reads it
    assert set(mx.load(str(tmp_path / "b.safetensors"))) == {"kv.3.0", "kv.3.1", "kv.7.0.0", "kv.7.0.1", "kv.7.0.2",
                                                              "kv.7.1.0", "kv.7.1.1", "kv.7.1.2", "state.5.cache.keys",
                                                              "state.5.cache.values"}
    with pytest.raises(ValueError):
        decode(data[: size // 2])


# -- one stage's tier ------------------------------------------------------------------


def test_missing_truncated_and_corrupt_files_are_dropped_with_a_log_line(tmp_path, caplog):
    tier = DiskTier(tmp_path, 0, 4, limit=1 << 20)
    for k in range(1, 5):
        tier.put(k, _block(k), False, 0)
    assert tier.flush()
    files = {int(f.name[:16], 16): f for f in _files(tier)}
    assert sorted(files) == [1, 2, 3, 4] and tier.blocks() == ([1, 2, 3, 4], [])
    files[2].unlink()
    files[3].write_bytes(files[3].read_bytes()[:-9])
    corrupt = bytearray(files[4].read_bytes())
    corrupt[-3] ^= 0x40
    files[4].write_bytes(bytes(corrupt))
    with caplog.at_level(logging.WARNING, logger="mlxpipe.shards.cache.disk"):
        got = tier.read([1, 2, 3, 4])  # (read in parallel: the ones after the first failure may be read too)
        assert [(k, why) for k, _, why in got][:2] == [(1, ""), (2, "its file is missing")]
        assert mx.array_equal(got[0][1]["kv"][0][0], _block(1)["kv"][0][0]).item()
        tier.read([3])
        tier.read([4])
    dropped = {r.getMessage()[13:29]: r.getMessage() for r in caplog.records if "dropped" in r.getMessage()}
    assert sorted(dropped) == [f"{k:016x}" for k in (2, 3, 4)]  # one line each, saying why
    assert "its file is truncated (" in dropped[f"{3:016x}"] and "fails its checksum" in dropped[f"{4:016x}"]
    assert tier.blocks() == ([1], []) and tier.stats.dropped == 3
    assert [f.name[:16] for f in _files(tier)] == [f"{1:016x}"]  # the bad files are gone too
    tier.close()


def test_the_disk_bound_is_never_exceeded_and_the_oldest_go_first(tmp_path):
    probe = DiskTier(tmp_path / "probe", 0, 4, limit=1 << 20)
    probe.put(1, _block(1), False, 0)
    probe.flush()
    size = _files(probe)[0].stat().st_size
    probe.close()
    tier = DiskTier(tmp_path / "tiny", 0, 4, limit=3 * size + size // 2)  # room for three blocks
    held = []
    for k in range(1, 9):
        tier.put(k, _block(k), False, 0)
        tier.flush()
        if k == 5:
            tier.read([3])  # read back: used recently
        assert sum(f.stat().st_size for f in _files(tier)) <= tier.limit
        held.append(sorted(tier.blocks()[0]))
    assert held[3:] == [[2, 3, 4], [3, 4, 5], [3, 5, 6], [3, 6, 7], [6, 7, 8]]  # 3 outlived 4 and 5
    assert tier.own_bytes == sum(f.stat().st_size for f in _files(tier)) and tier.stats.evicted == 5
    tier.discard([7])
    tier.flush()
    assert sorted(tier.blocks()[0]) == [6, 8] and len(_files(tier)) == 2
    tier.close()
    again = DiskTier(tmp_path / "tiny", 0, 4, limit=size + size // 2)  # restarted with a smaller bound
    assert again.blocks() == ([8], []) and len(_files(again)) == 1  # the oldest went before it reported
    again.close()
    small = DiskTier(tmp_path / "small", 0, 4, limit=size - 1)
    small.put(1, _block(1), False, 0)
    small.flush()
    assert _files(small) == [] and small.blocks() == ([], [])  # a block larger than the bound is not written
    small.close()


def test_a_full_disk_stops_writing_and_never_fails_a_read(tmp_path, monkeypatch, caplog):
    tier = DiskTier(tmp_path, 0, 4, limit=1 << 20)
    tier.put(1, _block(1), False, 0)
    tier.flush()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_cache, "open", full, raising=False)
    with caplog.at_level(logging.WARNING, logger="mlxpipe.shards.cache.disk"):
        tier.put(2, _block(2), False, 0)
        tier.flush()
    assert not tier.writable and any("stops writing" in r.getMessage() for r in caplog.records)
    tier.put(3, _block(3), False, 0)  # not even queued now
    tier.flush()
    assert tier.blocks() == ([1], []) and len(_files(tier)) == 1 and not list(tier.dir.glob(".tmp-*"))
    assert [why for _, _, why in tier.read([1])] == [""]
    tier.close()


def test_two_processes_never_write_one_directory(tmp_path):
    code = ("import sys, time; from pathlib import Path; from mlxpipe.shards.cache.disk import DiskTier; "
            "t = DiskTier(Path(sys.argv[1]), 0, 4, limit=1 << 20); print(t.dir.name, flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline().strip()
        mine = DiskTier(tmp_path, 0, 4, limit=1 << 20)
        assert theirs == "w0" and mine.dir.name == "w1"
        mine.put(1, _block(1), False, 0)
        mine.flush()
        assert not list((tmp_path / theirs).glob("*.safetensors"))
    finally:
        other.kill()
        other.wait()
    mine.close()
    again = DiskTier(tmp_path, 0, 4, limit=1 << 20)  # the directory whose files cover the range, free now
    assert again.dir.name == "w1" and again.blocks() == ([1], [])
    again.close()


def test_a_stage_whose_range_shrinks_still_reads_the_layers_it_keeps(tmp_path):
    tier = DiskTier(tmp_path, 2, 6, limit=1 << 20)
    tier.put(1, _block(1), False, 0)
    tier.flush()
    tier.retarget(3, 5)   # a re-plan gives it fewer layers: its files still cover them
    assert tier.blocks() == ([1], [])
    tier.retarget(1, 5)   # more: they do not (and go first when room is needed)
    assert tier.blocks() == ([], []) and len(tier.stale) == 1
    other = DiskTier(tmp_path, 4, 6, limit=1 << 20)  # another stage on the machine, while the first runs
    assert other.dir != tier.dir and other.blocks() == ([1], []) and other.own_bytes == 0  # read, not its own
    tree = other.read([1])[0][1]
    assert mx.array_equal(tree["kv"][0][0], _block(1)["kv"][0][0]).item()
    other.close()
    tier.close()
    again = DiskTier(tmp_path, 4, 6, limit=1 << 20)  # restarted alone: the directory that covers it is free
    assert again.dir == tier.dir and again.blocks() == ([1], []) and again.own_bytes > 0
    again.close()


def test_a_replanned_stage_reads_the_tiers_of_ranges_with_its_weights(tmp_path, monkeypatch):
    """A node's tier is the directory of the stage's weights digest (its range's): loaded with
    fewer layers, it writes a directory of its own and reads the files of the ranges that
    hold its layers with the same digests, never those of other weights."""
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path))
    units = {"config": "c", "layer-00000": "0", "layer-00001": "1", "layer-00002": "2"}
    wide = WeightsDigest(units)
    other = WeightsDigest(dict(units, **{"layer-00001": "changed in place"}))
    tiers = DiskService(1 << 20)
    for weights, key in ((wide, 1), (other, 2)):
        tier = tiers.for_load(pb.LoadRequest(start=0, end=3, block_tokens=4), weights)
        tier.put(key, _block(key), False, 0)
        assert tier.flush()
    narrow = WeightsDigest({u: units[u] for u in ("config", "layer-00001")})
    tier = tiers.for_load(pb.LoadRequest(start=1, end=2, block_tokens=4), narrow)
    assert tier.base.parent.name == narrow.stage != wide.stage and tier.blocks() == ([1], [])
    assert tier.own_bytes == 0 and mx.array_equal(tier.read([1])[0][1]["kv"][0][0], _block(1)["kv"][0][0]).item()
    tiers.close()


# -- the head's index of both tiers ----------------------------------------------------------


def test_the_index_counts_a_block_in_either_tier_where_every_stage_has_it():
    idx = PrefixIndex(B, capacity=10, num_stages=2)
    idx.reset([[1, 2], []], 10, disk=[[1, 2, 3], [1, 2, 3, 4]], disk_capacity=100)
    assert idx.match([1, 2, 3, 4]) == 3 and idx.match([4]) == 0  # stage 0 has no block 4 anywhere
    assert idx.fetches([1, 2, 3]) == [[3], [1, 2, 3]]
    assert list(idx.disk_lru)[0] == 4  # what not every stage has goes first
    idx.fetched(1, [2])  # stage 1 found block 2 corrupt
    assert idx.match([1, 2, 3]) == 1
    assert idx.evict(2) == [1, 2] and idx.match([1]) == 1  # evicted from memory: still on disk
    assert idx.discard(1) == [4] and idx.discard(5, protected={3}) == [1, 2]
    assert idx.match([1]) == 0 and idx.disk_blocks == 1


def _seq(i, prompt, max_tokens=2):
    return Seq(seq_id=i, prompt=list(prompt), max_tokens=max_tokens, sampling=Sampling())


def _answer(s, frames, token=7):
    for f in frames:
        s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=e.seq_id, token=token)
                                                           for e in f.seqs if e.sample]))


def _with_disk(held, disk, capacity=100, disk_capacity=100):
    s = Scheduler(SchedulerConfig(chunk_size=8, block_tokens=B, prefix_blocks=capacity, max_prefill_inflight=100,
                                  prefix_disk_blocks=disk_capacity))
    s.reset_prefix(held, capacity, disk=disk, disk_capacity=disk_capacity)
    return s


def test_a_sequence_waits_for_blocks_read_back_and_keeps_them_in_memory():
    prompt = list(range(100, 126))  # 26 tokens: 6 whole blocks before the last token
    keys = chain_hashes(prompt, B, [], 6)
    s = _with_disk([keys[:2], []], [keys, keys[:5]])  # stage 1 restarted: its memory is empty
    s.add(_seq(1, prompt))
    assert s.schedule() == []  # the first step waits for the blocks to be read back
    (fetch,) = s.take_fetches()
    assert fetch.keys == [keys[2:5], keys[:5]]
    s.fetched(fetch, [(keys[2:5], []), (keys[:3], [keys[3]])])  # stage 1 could not read block 3
    assert keys[3] not in s.prefix.disk[1] and keys[3] in s.prefix.disk[0]
    first = s.schedule()[0]
    e = first.seqs[0]
    assert list(e.reuse) == keys[:3] and e.offset == 3 * B  # recomputed from there, with the same tokens
    assert e.store_first == 0 and list(e.store) == keys[:3]  # kept in memory again (stage 0 had 0, 1 already)
    assert s.seqs[1].cached_tokens == 3 * B and s.seqs[1].disk_tokens == 3 * B


def test_a_sequence_ended_while_it_waited_is_freed_where_blocks_were_read():
    prompt = list(range(100, 118))
    keys = chain_hashes(prompt, B, [], 4)
    s = _with_disk([[], []], [keys, keys])
    s.add(_seq(1, prompt))
    s.schedule()
    (fetch,) = s.take_fetches()
    s.cancel(1)
    s.fetched(fetch, [(keys, []), (keys, [])])
    assert 1 in s.schedule()[0].free


def test_blocks_memory_has_no_room_for_are_written_to_disk_only():
    s = _with_disk([[], []], [[], []], capacity=2, disk_capacity=5)

    def run(prompt):
        s.add(_seq(len(s.seqs) + 100, prompt))
        frames = s.schedule()
        sent = list(frames)
        while frames:
            _answer(s, frames)
            frames = s.schedule()
            sent += frames
        return sent

    first = list(range(100, 126))  # 6 blocks, all stored in one round: memory holds 2 of them
    sent = run(first)
    stored = [k for f in sent for e in f.seqs for k in e.store]
    spilled = [k for f in sent for e in f.seqs for k in e.spill]
    keys = chain_hashes(first, B, [], 6)
    assert stored == keys[:2] and spilled == keys[2:5]  # once each, in order, within the disk's bound
    assert s.prefix.blocks == 2 and s.prefix.disk_blocks == 5
    sent = run(list(range(300, 326)))
    assert sum(len(f.discard) for f in sent) >= 2 and s.prefix.disk_blocks == 5 and s.prefix.blocks <= 2
    assert keys[0] not in s.prefix.disk_lru  # the oldest went first


# -- equality with mlx-lm, blocks read back from disk -------------------------------------------


def _chat(tok, *turns):
    messages = [{"role": "system", "content": "You are a careful assistant. Answer in two sentences."}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return tok.apply_chat_template(messages, add_generation_prompt=len(turns) % 2 == 1)


def test_greedy_tokens_from_blocks_on_disk_equal_mlx_lm(dsv3_model, reference, tmp_path, caplog):
    """Two stages write, then three read back (a re-plan: each reads the layers it keeps from
    files that cover more), then a truncated file: mlx-lm's tokens every time. (The tiny
    DeepSeek-V3 only: the default model's caches are of the same kinds, and its three loads
    cost most of a minute of CI.)"""
    from mlx_lm.utils import load_tokenizer

    path, ranges, again = dsv3_model, [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]
    tok = load_tokenizer(path)
    config = SchedulerConfig(chunk_size=16, block_tokens=8, prefix_blocks=4096, num_groups=len(again),
                             prefix_disk_blocks=1 << 16)
    first = _chat(tok, "Name three rivers in Europe.")
    pipe = InProcess(path, ranges, config, eos=tok.eos_token_ids, disk=tmp_path)
    (out,), _ = pipe.generate([first], 10)
    assert out == reference(path, first, 10)
    pipe.close()  # the stages stop
    pipe = InProcess(path, again, config, eos=tok.eos_token_ids, disk=tmp_path)  # and start again: memory empty
    later = first + out + tok.encode(" And in Asia?")
    outs, seqs = pipe.generate([first, later], 10)
    assert outs == [reference(path, first, 10), reference(path, later, 10)]
    assert seqs[0].cached_tokens == (len(first) - 1) // 8 * 8 and seqs[0].disk_tokens == seqs[0].cached_tokens
    assert seqs[1].cached_tokens >= seqs[0].cached_tokens
    pipe.close()
    files = sorted(next(p for p in tmp_path.iterdir() if p.name == "w0").glob("*.safetensors"),
                   key=os.path.getmtime)
    files[1].write_bytes(files[1].read_bytes()[:100])  # truncated: among the first prompt's blocks
    pipe = InProcess(path, again, config, eos=tok.eos_token_ids, disk=tmp_path)
    with caplog.at_level(logging.WARNING, logger="mlxpipe.shards.cache.disk"):
        (out2,), (seq,) = pipe.generate([first], 10)
    assert out2 == reference(path, first, 10)
    assert any("truncated" in r.getMessage() for r in caplog.records)
    assert seq.cached_tokens < seqs[0].cached_tokens
    pipe.close()


def test_a_tiny_memory_tier_leaves_the_hits_to_the_disk(dsv3_model, reference, tmp_path):
    """Memory for two blocks: what a prompt stores mostly spills to disk, and the next
    prompts that share it read it back from there, with mlx-lm's tokens."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(dsv3_model)
    config = SchedulerConfig(chunk_size=16, block_tokens=8, prefix_blocks=2, num_groups=2, prefix_disk_blocks=1 << 16)
    pipe = InProcess(dsv3_model, [(0, 2), (2, 4)], config, eos=tok.eos_token_ids, disk=tmp_path)
    first, other = _chat(tok, "Name three rivers in Europe."), _chat(tok, "Name three mountains in Asia.")
    outs, _ = pipe.generate([first, other], 8)
    (again,), (seq,) = pipe.generate([first], 8)
    assert [*outs, again] == [reference(dsv3_model, p, 8) for p in (first, other, first)]
    assert seq.cached_tokens == (len(first) - 1) // 8 * 8 and seq.disk_tokens >= seq.cached_tokens - 2 * 8
    assert all(st.prefix.disk.stats.reads > 0 and len(st.prefix.blocks) <= 2 for st in pipe.stages)
    # What memory holds is counted as it is (blocks read back came uncounted: the count went
    # negative, /health's Stage.Health failed on it and the head rebuilt the pipeline).
    assert all(st.prefix.nbytes == sum(b.nbytes for b in st.prefix.blocks.values()) for st in pipe.stages)
    pipe.close()


def test_a_block_read_back_is_counted_while_memory_holds_it():
    from mlxpipe.shards.cache.prefix import BlockStore

    store = BlockStore(B, slots=[0])
    block = store._block(_block(1.0))  # as the Fetch RPC stages it
    store.keep(7, [], 0, staged=block)
    assert store.nbytes == block.nbytes > 0
    store.keep(7, [], 0, staged=store._block(_block(2.0)))  # held already: kept once
    assert store.nbytes == block.nbytes
    store.drop([7])
    assert store.nbytes == 0


def test_the_head_sizes_the_disk_tier_from_every_stage_and_none_turns_it_off():
    from mlxpipe.server.cluster.sizing import disk_blocks

    loads = [pb.LoadReply(block_tokens=16, kv_bytes_per_token=100, disk_limit_bytes=10_000_000, disk_block_bytes=2000),
             pb.LoadReply(block_tokens=16, kv_bytes_per_token=100, disk_limit_bytes=1_000_000, disk_block_bytes=2500)]
    assert disk_blocks(loads) == 400  # the tightest stage's bound over its block's file
    loads[1].disk_limit_bytes = 0     # a node that keeps none (`mlxpipe node --prefix-cache-disk 0`)
    assert disk_blocks(loads) == 0


def test_quantized_kv_blocks_go_to_disk_as_they_are(default_model, reference, tmp_path):
    """KV caches quantized at 8 bits (``--kv-bits 8``): a block past its sequence's switch
    point is kept quantized, written to disk as it is (the keys' and values' packed data,
    scales and biases) and read back by stages started afresh on the same disk: mlx-lm's
    tokens with ``kv_bits=8``, from a disk hit. The prompt runs past mlx-lm's first prefill
    call (2048 tokens, where it switches), so that a resend reuses quantized blocks. A tiny
    Llama: its attention reads quantized keys (DeepSeek-V3's MLA caches stay unquantized)."""
    from mlx_lm.utils import load_tokenizer
    from tiny_models import build_llama_source

    from mlxpipe.shards.params.kv import KvQuant

    path = build_llama_source(tmp_path / "llama", default_model, max_position_embeddings=4096)
    eos = load_tokenizer(path).eos_token_ids
    prompt = [(i * 7919) % 40000 + 100 for i in range(2048 + 50)]
    kv = KvQuant(8, 32, 0)  # (its heads are 32 wide)
    config = SchedulerConfig(chunk_size=512, block_tokens=16, prefix_blocks=4096, num_groups=2,
                             prefix_disk_blocks=1 << 16, kv_start=kv.start)
    want = reference(path, prompt, 8, (kv.bits, kv.group_size, kv.start))
    pipe = InProcess(path, [(0, 2), (2, 4)], config, eos, kv=kv, disk=tmp_path / "disk")
    assert all(st.kv.slots for st in pipe.stages)
    (out,), (seq,) = pipe.generate([prompt], 8)
    assert out == want and seq.kv_at == 2048
    pipe.close()
    files = list((tmp_path / "disk").rglob("*.safetensors"))
    packed = [f for f in files if any(a.dtype == mx.uint32 for a in mx.load(str(f)).values())]
    assert packed and len(packed) < len(files)  # blocks past the switch quantized, those before at full precision
    pipe = InProcess(path, [(0, 2), (2, 4)], config, eos, kv=kv, disk=tmp_path / "disk")  # memory empty
    (again,), (seq,) = pipe.generate([prompt], 8)
    assert again == want
    assert seq.cached_tokens == seq.disk_tokens == (len(prompt) - 1) // 16 * 16  # all of it from disk
    kept = [b.kv[0][0] for b in pipe.stages[1].prefix.blocks.values()]  # read back, kept in memory again
    assert sum(isinstance(k, tuple) and k[0].dtype == mx.uint32 for k in kept) == len(packed) // 2
    pipe.close()
    # A node keeps each KV quantization's blocks apart (the same keys hold other bits at 4).
    tiers = DiskService(1 << 20)
    load = pb.LoadRequest(start=0, end=2, block_tokens=16)
    weights = WeightsDigest({"config": "c", "layer-00000": "0", "layer-00001": "1"})
    roots = {tiers.for_load(load, weights, q).base for q in (kv, KvQuant(4, 32, 0), None)}
    assert len(roots) == 3 and tiers.for_load(load, weights, kv).base in roots
    tiers.close()
