"""Speculative decoding: drafts (pure), the scheduler's verify/judge/trim logic
(pure), and token-for-token equality with plain decoding."""

from __future__ import annotations

import pytest
from conftest import REPEAT_CODE
from inproc import InProcess, WiredScheduler as Scheduler  # (the scheduler's steps as frames)

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.budget import KindTotals
from mlxpipe.server.core.drafting import PromptLookup
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.server.core.sequence import Phase, Seq
from mlxpipe.server.core.speculation import verify_positions
from mlxpipe.shards.params.sampling import Sampling


def test_prompt_lookup_continues_the_latest_match():
    d = PromptLookup()
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert d.propose(tokens, 3, confirmed=len(tokens)) == [4, 5, 9]
    tokens += [7, 1, 2]  # now "1 2" was last followed by 3 and by 7: the latest wins
    assert d.propose(tokens, 2, confirmed=len(tokens)) == [3, 7]
    assert PromptLookup().propose([5, 6, 7, 8], 3, confirmed=4) == []   # nothing repeats
    # A list's lines that end alike: "5 5 5 8" was last followed by 1 3 (line b), but the line
    # being copied is a, as the longer "12 5 5 5 8" says.
    a, b = [11, 12, 5, 5, 5], [21, 22, 5, 5, 5]
    lines = [*a, 8, 1, 9, *b, 8, 1, 3, *a, 8]
    assert PromptLookup().propose(lines, 2, confirmed=len(lines)) == [1, 9]
    assert PromptLookup(max_ngram=3).propose(lines, 2, confirmed=len(lines)) == [1, 3]
    # One token in common drafts nothing: "4" was followed by 5, but a lone word's
    # latest occurrence says little of what follows it (in chat, right 14% of the time).
    assert PromptLookup().propose([4, 5, 6, 7, 4], 2, confirmed=5) == []
    assert PromptLookup(min_ngram=1).propose([4, 5, 6, 7, 4], 2, confirmed=5) == [5, 6]
    # Unjudged drafts extend the key but never enter the index.
    d = PromptLookup()
    assert d.propose([1, 2, 3, 1, 2, 3, 4], 2, confirmed=6) == []


def test_frames_per_verify_follow_what_rows_cost():
    assert verify_positions(1.0, 2) == 1   # CPU: each stage works on its own position
    assert verify_positions(0.7, 2) == 1
    assert verify_positions(0.0, 2) == 5   # rows free (Apple silicon): one frame holds them all
    assert verify_positions(1.0, 1) == 5   # one stage: no pipeline to fill, fewer frames


# -- the scheduler, driven by hand ------------------------------------------------------


def _running(s, prompt, max_tokens=40):
    """A sequence through its prefill, decoding in a group, with token 50 sampled."""
    seq = Seq(seq_id=1, prompt=list(prompt), max_tokens=max_tokens, sampling=Sampling())
    s.add(seq)
    for f in s.schedule():
        s.on_result(pb.Result(frame_id=f.frame_id, tokens=[pb.TokenResult(seq_id=1, token=50)] if f.seqs[0].sample else []))
    assert seq.phase == Phase.RUNNING
    return seq


def _one_token_matches(seq):
    """A drafter that drafts from a one-token match too, so these prompts stay short."""
    return PromptLookup(min_ngram=1)


def _answer(s, frame, tokens):
    return s.on_result(pb.Result(frame_id=frame.frame_id, tokens=[pb.TokenResult(seq_id=1, token=t) for t in tokens]))


def test_drafts_are_verified_position_by_position_and_a_miss_is_trimmed():
    s = Scheduler(SchedulerConfig(speculate=True, spec_depth=4, spec_positions=1, spec_frames=8, max_prefill_inflight=8),
                  drafters=_one_token_matches)
    # The prompt has 50 51 52 53 9 ...; 50 is sampled: the drafts after it are 51 52 53 9.
    seq = _running(s, [50, 51, 52, 53, 9, 8, 7, 6, 5])
    frames = s.schedule()
    assert [f.kind for f in frames] == [pb.Frame.VERIFY] * 5
    assert [list(f.tokens) for f in frames] == [[50], [51], [52], [53], [9]]
    assert [f.seqs[0].offset for f in frames] == [9, 10, 11, 12, 13]
    # The model samples 51, 52, then 7 where the draft said 53: tokens 51, 52, 7 count.
    assert [e.token for e in _answer(s, frames[0], [51])] == [51]
    assert [e.token for e in _answer(s, frames[1], [52])] == [52]
    assert [e.token for e in _answer(s, frames[2], [7])] == [7]
    assert _answer(s, frames[3], [9]) == [] and _answer(s, frames[4], [8]) == []  # stale: after the miss
    assert seq.generated[-4:] == [50, 51, 52, 7]
    nxt = s.schedule()
    # The stages hold positions 9..13; 9, 10, 11 are confirmed now: the first frame drops
    # 12 and 13 and feeds 7 there. The miss halved the depth: 2 drafts after it (6 5, from the prompt).
    assert [f.kind for f in nxt] == [pb.Frame.VERIFY] * 3
    assert nxt[0].seqs[0].trim == 2 and nxt[0].seqs[0].offset == 12
    assert [list(f.tokens) for f in nxt] == [[7], [6], [5]] and not nxt[1].seqs[0].trim


def test_verify_frames_in_flight_stay_within_the_stages():
    # Positions 1 per frame, 2 stages: a third frame would wait at stage 0 and be lost on a miss.
    s = Scheduler(SchedulerConfig(speculate=True, spec_depth=4, spec_positions=1, spec_frames=2,
                                  max_prefill_inflight=8), drafters=_one_token_matches)
    _running(s, [50, 51, 52, 53, 9, 8, 7, 6, 5])
    first = s.schedule()
    assert [list(f.tokens) for f in first] == [[50], [51]]
    assert [e.token for e in _answer(s, first[0], [51])] == [51]
    nxt = s.schedule()  # one came back: one more goes out, the next draft
    assert [list(f.tokens) for f in nxt] == [[52]] and nxt[0].seqs[0].offset == 11


def test_speculation_stops_when_the_pipeline_fills_and_rejoins_with_a_trim():
    s = Scheduler(SchedulerConfig(speculate=True, spec_depth=2, spec_max_running=1, spec_frames=8,
                                  max_prefill_inflight=8), drafters=_one_token_matches)
    _running(s, [50, 51, 52, 9])  # 50 sampled: drafts 51 52
    (f1, f2, f3) = s.schedule()
    _answer(s, f1, [51]), _answer(s, f2, [99]), _answer(s, f3, [1])  # a miss at the second position
    s.add(Seq(seq_id=2, prompt=[5, 6, 7], max_tokens=4, sampling=Sampling()))
    frames = s.schedule()  # two sequences now: more than spec_max_running
    decode = [f for f in frames if f.kind == pb.Frame.DECODE]
    assert decode and decode[0].seqs[0].seq_id == 1 and decode[0].seqs[0].trim == 1
    assert s.solo == []


def test_speculation_waits_for_a_timed_decode_and_pauses_where_it_does_not_pay():
    """Speculation is decided by measured cost: a sequence decodes in its group until
    a decode frame is timed; a trial window whose confirmed tokens per second do not
    beat one per decode round trip sends it back for PAUSE decode steps, doubled
    after each further failed trial; a trial that pays keeps it verifying."""
    from mlxpipe.server.core.speculation import PAUSE, TRIAL_FRAMES

    costs, now = {}, [0.0]
    s = Scheduler(SchedulerConfig(speculate=True, spec_depth=2, spec_positions=1, spec_frames=8,
                                  max_prefill_inflight=8), costs=lambda: costs)
    s.speculator.clock = lambda: now[0]
    prompt = [50, 51, 52, 9] * 4

    def _next(seq):  # what the model samples: the pattern goes on
        return prompt[len(seq.tokens) % len(prompt)]

    seq = _running(s, prompt, max_tokens=400)
    (first,) = s.schedule()
    assert first.kind == pb.Frame.DECODE  # nothing timed yet: nothing to weigh speculation against
    costs["decode"] = KindTotals(frame_s=1.0)
    _answer(s, first, [51])

    def trial(seconds_per_token):
        """Speculate until a trial window ends, each frame's samples matching its drafts."""
        while True:
            frames = s.schedule()
            if not frames or frames[0].kind == pb.Frame.DECODE:
                return frames
            for f in frames:
                now[0] += seconds_per_token
                _answer(s, f, [_next(seq)])

    # A slow pipeline: 3 s per confirmed token against 1 s per decode step.
    frames = trial(3.0)
    assert frames and frames[0].kind == pb.Frame.DECODE and seq.spec_state.pause == PAUSE
    assert s.drafts.trials == 1 and s.drafts.paid == 0
    decodes = 0
    while frames[0].kind == pb.Frame.DECODE:  # its pause, decoding in the group
        decodes += 1
        _answer(s, frames[0], [_next(seq)])
        frames = s.schedule()
    assert decodes == PAUSE and frames[0].kind == pb.Frame.VERIFY  # then a new trial
    for f in frames:
        _answer(s, f, [_next(seq)])
    frames = trial(3.0)
    assert frames[0].kind == pb.Frame.DECODE and seq.spec_state.pause == 2 * PAUSE  # failed again: twice as long
    seq.spec_state.cooldown = 0  # (its second pause skipped)
    _answer(s, frames[0], [_next(seq)])
    # A fast one: it keeps verifying past many trial windows.
    for _ in range(4 * TRIAL_FRAMES):
        frames = s.schedule()
        assert frames and frames[0].kind == pb.Frame.VERIFY
        for f in frames:
            now[0] += 0.3
            _answer(s, f, [_next(seq)])
    assert s.drafts.paid >= 2 and seq.spec_state.pause == 0


# -- equality, in one process ------------------------------------------------------------------


def _code_prompt(tok):
    return tok.apply_chat_template([{"role": "user", "content": REPEAT_CODE}], add_generation_prompt=True)


# (Two stages with one position per frame, the CPU case, runs through real stage
# processes in test_equality.py.)
@pytest.mark.parametrize("model,ranges,positions", [
    pytest.param("default_model", [(0, 30)], 9, marks=pytest.mark.extended),  # (one stage: 2 in the default run)
    ("default_model", [(0, 13), (13, 30)], 3),
    ("dsv3_model", [(0, 1), (1, 3), (3, 4)], 1),
])
def test_speculative_tokens_equal_plain_decoding(model, ranges, positions, request, reference):
    from mlx_lm.utils import load_tokenizer

    path = request.getfixturevalue(model)
    tok = load_tokenizer(path)
    config = SchedulerConfig(chunk_size=64, speculate=True, spec_depth=8, spec_positions=positions,
                             num_groups=len(ranges), spec_max_running=len(ranges), spec_frames=max(len(ranges), 2))
    pipe = InProcess(path, ranges, config, eos=tok.eos_token_ids)
    code = _code_prompt(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], add_generation_prompt=True)
    for prompt in (code, chat):
        (out,), _ = pipe.generate([prompt], 24)
        assert out == reference(path, prompt, 24)
        if prompt is code and model == "default_model":
            assert pipe.scheduler.drafts.accepted > 0, "the code block should be copied from the prompt"
    # Sampled, with a seed: the same tokens as without speculation.
    plain = InProcess(path, ranges, SchedulerConfig(chunk_size=64, num_groups=len(ranges)), eos=tok.eos_token_ids)
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=7, repetition_penalty=1.1)
    assert pipe.generate([code], 16, sampling)[0] == plain.generate([code], 16, sampling)[0]
