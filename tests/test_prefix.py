"""The prefix cache: the head's index (pure), the scheduler's use of it, and
greedy equality with mlx-lm when prompts start from cached blocks."""

from __future__ import annotations

import pytest
from inproc import InProcess, WiredScheduler as Scheduler  # (the scheduler's steps as frames)

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.kv_budget import KvBudget
from mlxpipe.server.core.prefix_index import PrefixIndex, chain_hashes, model_salt
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.params.sampling import Sampling

B = 4  # block tokens in the pure tests


# -- keys and the index -------------------------------------------------------------


def test_chained_keys_cover_the_whole_prefix():
    a = chain_hashes(list(range(20)), B, [], 5)
    b = chain_hashes(list(range(9)) + [99] + list(range(10, 20)), B, [], 5)
    assert len(a) == 5 and len(set(a)) == 5
    assert a[:2] == b[:2]          # blocks before the change agree
    assert a[2] != b[2] and a[3] != b[3] and a[4] != b[4]  # block 2 and every later one differ
    assert chain_hashes(list(range(20)), B, a[:2], 5) == a  # extending continues the chain


def test_a_block_counts_only_when_every_stage_holds_it():
    idx = PrefixIndex(B, capacity=10, num_stages=2)
    assert idx.reset([[1, 2, 3], [1, 2]], 10) == []
    assert idx.match([1, 2, 3]) == 2   # stage 1 lost block 3 (say, it was restarted)
    assert idx.match([7]) == 0


def test_the_index_evicts_least_recently_used_blocks_but_not_protected_ones():
    idx = PrefixIndex(B, capacity=3, num_stages=2)
    idx.reset([[], []], 3)
    evicted = []
    assert idx.add([1, 2, 3], set(), evicted, 10) == 3 and evicted == []
    idx.touch([1])
    assert idx.add([4], set(), evicted, 10) == 1 and evicted == [2]
    # Room for one: 1 goes; 3 and 4 are protected, and so is 5, just added: 6 does not fit.
    assert idx.add([5, 6], {3, 4}, evicted, 10) == 1
    assert evicted == [2, 1] and list(idx.lru) == [3, 4, 5]
    assert idx.add([7], set(), evicted, 1) == 1 and list(idx.lru) == [7]  # room for one only
    assert idx.reset([[1, 2, 3, 4], [1]], 2) == [1, 2]  # over capacity after a rebuild: oldest go


# -- the scheduler -----------------------------------------------------------------------


def _seq(i, prompt, max_tokens=3, **sampling):
    return Seq(seq_id=i, prompt=list(prompt), max_tokens=max_tokens,
                    sampling=Sampling(**sampling))


def _finish(s, frames, token=7):
    """Answer frames as a last stage would, until the scheduler is idle; returns all frames."""
    sent = list(frames)
    while frames:
        for f in frames:
            s.on_result(pb.Result(frame_id=f.frame_id, tokens=[
                pb.TokenResult(seq_id=e.seq_id, token=token) for e in f.seqs if e.sample]))
        frames = s.schedule()
        sent += frames
    return sent


def _scheduler(capacity=100, max_kv_tokens=1 << 20):
    s = Scheduler(SchedulerConfig(chunk_size=8, block_tokens=B, prefix_blocks=capacity,
                                  max_kv_tokens=max_kv_tokens, max_prefill_inflight=100))
    s.reset_prefix([[], []], capacity)
    return s


def test_later_frames_store_completed_blocks_and_the_next_request_reuses_them():
    s = _scheduler()
    prompt = list(range(100, 118))  # 18 tokens: blocks 0-3 complete before the last token
    s.add(_seq(1, prompt))
    frames = _finish(s, s.schedule())
    stores = [(f.seqs[0].store_first, len(f.seqs[0].store)) for f in frames if f.seqs and f.seqs[0].store]
    # chunk [0, 8), chunk [8, 16) stores blocks 0-1, the last prompt token stores 2-3,
    # then decode steps store what the generated tokens complete.
    assert stores[:2] == [(0, 2), (2, 2)]
    s.add(_seq(2, prompt[:14] + [5, 6, 7, 8, 9]))  # shares 14 tokens: 3 whole blocks
    first = s.schedule()[0]
    assert list(first.seqs[0].reuse) == chain_hashes(prompt, B, [], 3)
    assert first.seqs[0].offset == 3 * B and list(first.tokens) == (prompt[:14] + [5, 6, 7, 8, 9])[12:18]
    assert s.seqs[2].cached_tokens == 12


def test_a_prompt_held_whole_still_computes_its_last_token():
    s = _scheduler()
    prompt = list(range(50, 66))  # exactly 4 blocks
    s.add(_seq(1, prompt))
    _finish(s, s.schedule())
    s.add(_seq(2, prompt))
    first = s.schedule()[0]
    assert len(first.seqs[0].reuse) == 3 and first.seqs[0].offset == 12 and len(first.tokens) == 3


def test_cached_blocks_give_way_to_live_sequences():
    s = _scheduler(capacity=100, max_kv_tokens=40)
    s.add(_seq(1, list(range(100, 125)), max_tokens=3))   # 25 + 3 positions; completes 6 blocks
    _finish(s, s.schedule())
    assert s.prefix.tokens == 12  # what its own reservation left room for
    s.add(_seq(2, list(range(300, 333)), max_tokens=3))   # needs 36 of 40: cached blocks must go
    frames = s.schedule()
    assert len(frames[0].evict) >= 2, "admission should have evicted at least two cached blocks"
    assert s.prefix.tokens + 36 <= 40
    _finish(s, frames)
    assert s.prefix.tokens + s.kv_reserved <= 40


def test_a_salt_keeps_one_tenants_prefixes_from_another():
    """Sequences with different salts (API keys, cache_salt) never reuse each other's
    blocks, nor report them cached; the same salt does."""
    assert chain_hashes(list(range(8)), B, [], 2, b"a") != chain_hashes(list(range(8)), B, [], 2)
    assert chain_hashes(list(range(8)), B, [], 2, b"a") != chain_hashes(list(range(8)), B, [], 2, b"b")
    s = _scheduler()
    prompt = list(range(100, 118))

    def run(i, salt):
        s.add(Seq(seq_id=i, prompt=prompt, max_tokens=3, sampling=Sampling(), salt=salt))
        frames = s.schedule()
        reuse, cached = list(frames[0].seqs[0].reuse), s.seqs[i].cached_tokens
        _finish(s, frames)
        return reuse, cached

    assert run(1, b"tenant a") == ([], 0)
    assert run(2, b"tenant b") == ([], 0)
    assert run(3, b"") == ([], 0)
    reuse, cached = run(4, b"tenant a")
    assert reuse == chain_hashes(prompt, B, [], 4, b"tenant a") and cached == 16
    assert run(5, b"tenant b")[1] == 16 and run(6, b"")[1] == 16
    # Stages that load other weights (a rebuilt pipeline): another model's salt, so no hit,
    # and a live sequence's keys are made again from it; the same weights keep them.
    live = Seq(seq_id=7, prompt=prompt, max_tokens=3, sampling=Sampling(), hashes=[1, 2])
    s.kv.set_model(model_salt([{"layer-00000": "a"}]), [live])
    assert live.hashes == [] and run(8, b"")[1] == 0 and run(9, b"")[1] == 16
    live.hashes[:] = [1, 2]
    s.kv.set_model(model_salt([{"layer-00000": "a"}]), [live])
    assert live.hashes == [1, 2]
    assert model_salt([{"a": "1"}, {"b": "2"}]) == model_salt([{"a": "1", "b": "2"}]) != model_salt([{"a": "1"}])


def test_a_wave_of_like_prompts_admitted_together_computes_their_prefix_once():
    """Sequences admitted in one round, before any of their prefix was cached: each one's first
    step starts after the blocks the first one's steps stored since (``KvBudget.relook``)."""
    s = Scheduler(SchedulerConfig(chunk_size=4, block_tokens=B, prefix_blocks=100, max_prefill_inflight=2))
    s.reset_prefix([[], []], 100)
    prompt = list(range(100, 118))  # 18 tokens: 4 whole blocks before the last one
    for i in (1, 2, 3):
        s.add(_seq(i, prompt))
    firsts = {}
    for f in _finish(s, s.schedule()):
        for e in f.seqs:
            firsts.setdefault(e.seq_id, e)
    assert [(firsts[i].offset, len(firsts[i].reuse)) for i in (1, 2, 3)] == [(0, 0), (16, 4), (16, 4)]


def test_a_first_step_starts_after_blocks_stored_this_round_only_when_it_goes_after_them():
    """An interactive sequence's step may reach the stages before this round's batch steps
    (``Priorities.order``): its relook takes only blocks stored in earlier rounds."""
    kv = KvBudget(1 << 20, B, 100)
    kv.reset_prefix([[], []], 100)
    kv.set_room(0)
    prompt = list(range(100, 118))
    first = _seq(1, prompt)
    first.feed = list(prompt)
    kv.new_round()
    assert len(kv.store(first, 8)[1]) == 2  # its step at 8 has the stages keep blocks 0-1
    later = _seq(2, prompt, max_tokens=3)
    later.feed, later.cached_tokens = list(prompt), 0
    kv.relook(later, settled=True)
    assert later.reuse == [] and later.sent == 0
    kv.relook(later)
    assert later.reuse == first.hashes[:2] and later.sent == later.cached_tokens == 8
    kv.new_round()
    other = _seq(3, prompt)
    other.feed = list(prompt)
    kv.relook(other, settled=True)
    assert len(other.reuse) == 2


def test_penalties_get_the_reused_tokens_they_look_back_at():
    s = _scheduler()
    prompt = list(range(100, 130))
    s.add(_seq(1, prompt))
    _finish(s, s.schedule())
    s.add(_seq(2, prompt, repetition_penalty=1.3, repetition_context_size=5))
    first = s.schedule()[0]
    reused = len(first.seqs[0].reuse) * B
    assert reused > 5 and list(first.seqs[0].context) == prompt[reused - 20 : reused]


def test_replay_starts_from_what_the_rebuilt_stages_hold():
    s = _scheduler()
    prompt = list(range(100, 121))
    s.add(_seq(1, prompt, max_tokens=50))
    frames = s.schedule()
    for f in frames:
        s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=1, token=3)]))
    held = list(s.prefix.lru)
    s.replay_all()
    s.reset_prefix([held, held[:2]], 100)  # stage 1 kept only two blocks
    first = s.schedule()[0]
    assert len(first.seqs[0].reuse) == 2 and first.seqs[0].offset == 2 * B


# -- equality with mlx-lm, in one process ---------------------------------------------


def _chat(tok, *turns):
    messages = [{"role": "system", "content": "You are a careful assistant. Answer in two sentences."}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return tok.apply_chat_template(messages, add_generation_prompt=len(turns) % 2 == 1)


@pytest.mark.parametrize("model,ranges", [("default_model", [(0, 11), (11, 30)]),
                                          ("dsv3_model", [(0, 1), (1, 3), (3, 4)])])
def test_greedy_tokens_with_cache_hits_equal_mlx_lm(model, ranges, request, reference):
    from mlx_lm.utils import load_tokenizer

    path = request.getfixturevalue(model)
    tok = load_tokenizer(path)
    config = SchedulerConfig(chunk_size=8, block_tokens=8, prefix_blocks=4096, num_groups=len(ranges))
    pipe = InProcess(path, ranges, config, eos=tok.eos_token_ids)
    first = _chat(tok, "Name three rivers in Europe.")
    # With a like prompt admitted in the same round: its first step starts after the blocks the
    # first one stored since (``KvBudget.relook``), and its tokens are still mlx-lm's.
    wave = first + tok.encode(" Keep it short.")
    (out, wave_out), (seq, wave_seq) = pipe.generate([first, wave], 12)
    assert seq.cached_tokens == 0 and out == reference(path, first, 12)
    assert wave_seq.cached_tokens > 0 and wave_out == reference(path, wave, 12)
    prompts = [
        first,                                                   # the same prompt again
        first + out + tok.encode(" And in Asia?"),               # a later turn: the answer's blocks too
        first[:-3] + tok.encode(" Africa?") + first[-2:],        # diverges inside a block
        first[: 8 * 3 + 5],                                      # a hit that ends mid-block
    ]
    outs, seqs = pipe.generate(prompts, 12)
    for p, o, s in zip(prompts, outs, seqs):
        assert o == reference(path, p, 12)
    # Blocks the first run stored: its prompt's, and its answer's up to the last token fed back.
    stored = (len(first) + len(out) - 2) // 8
    assert [s.cached_tokens for s in seqs] == [
        (len(first) - 1) // 8 * 8, min(stored, (len(prompts[1]) - 1) // 8) * 8, (len(first) - 3) // 8 * 8, 24]
    # Stage 1 loses its blocks (a restart): no stage may start after blocks it lacks.
    pipe.stages[1].prefix.clear()
    pipe.reset_prefix()
    (again,), (s,) = pipe.generate([first], 12)
    assert s.cached_tokens == 0 and again == reference(path, first, 12)
    assert pipe.stages[0].prefix_bytes() > 0  # stage 0 kept its own
