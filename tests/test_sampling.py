"""Token choice on the last stage: mlx-lm's samplers, per-sequence seeds, validation."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxpipe.shards.params import wire
from mlxpipe.shards.params.sampling import Sampling, SamplingError
from mlxpipe.shards.worker.sampler import SeqSampler, pick_batch

V = 64


def logits(rows=1, seed=0):
    mx.random.seed(seed)
    return mx.random.normal((rows, V)) * 3


def test_greedy_rows_match_argmax_of_log_softmax():
    x = logits(4)
    picks = pick_batch([SeqSampler(Sampling()) for _ in range(4)], x, [0] * 4)
    want = mx.argmax(x - mx.logsumexp(x, axis=-1, keepdims=True), axis=-1).tolist()
    assert [p[0] for p in picks] == want


def test_same_seed_same_tokens_different_seed_different_tokens():
    x = logits()
    params = Sampling(temperature=1.5, seed=42)

    def draw(p, positions):
        s = SeqSampler(p)
        return [pick_batch([s], x, [pos])[0][0] for pos in positions]

    a = draw(params, range(40))
    assert a == draw(params, range(40))
    other = Sampling(temperature=1.5, seed=43)
    assert a != draw(other, range(40))
    assert len(set(a)) > 3  # it is sampling, not greedy


def test_logprobs_and_top_logprobs():
    x = logits()
    s = SeqSampler(Sampling(logprobs=True, top_logprobs=3))
    ((token, lp, (ids, lps)),) = pick_batch([s], x, [0])
    ref = (x - mx.logsumexp(x, axis=-1, keepdims=True))[0]
    order = mx.argsort(-ref).tolist()
    assert token == order[0] and ids == order[:3]
    assert lp == pytest.approx(ref[token].item(), abs=1e-5)
    assert lps == pytest.approx([ref[i].item() for i in ids], abs=1e-5)


def test_repetition_penalty_uses_the_history():
    x = mx.zeros((1, V))
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    s = SeqSampler(Sampling(repetition_penalty=1.5))
    s.observe([5])
    assert pick_batch([s], x, [1])[0][0] == 6


def test_logit_bias():
    x = logits()
    s = SeqSampler(Sampling(logit_bias={9: 100.0}))
    assert pick_batch([s], x, [0])[0][0] == 9


@pytest.mark.parametrize("params,message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=V), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(top_logprobs=21), "top_logprobs"),
    (dict(logit_bias={V + 3: 1.0}), "logit_bias"),
])
def test_impossible_parameters_are_refused(params, message):
    with pytest.raises(SamplingError, match=message):
        Sampling(**params).validate(V)


def test_wire_round_trip_keeps_every_parameter():
    s = Sampling(temperature=0.75, top_p=0.875, top_k=5, min_p=0.0625, repetition_penalty=1.25,  # float32-exact
                 repetition_context_size=30, presence_penalty=0.5, frequency_penalty=-0.5,
                 penalty_context_size=40, seed=(1 << 64) - 1, logprobs=True, top_logprobs=4,
                 logit_bias={3: -5.0}, grammar="start: \"x\"")
    assert wire.sampling_from_wire(wire.sampling_to_wire(s)) == s
    assert wire.sampling_from_wire(wire.sampling_to_wire(Sampling())) == Sampling()


def _peaked(dtype):
    """Log-probabilities [1, V] with one clear favourite, in ``dtype``."""
    x = logits(seed=3)
    x = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return x.astype(dtype), mx.argmax(x, axis=-1).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("temperature", [1e-5 / 2, 1e-6, 1e-39, 1.4e-45])
def test_tiny_temperatures_draw_the_argmax(dtype, temperature):
    """1/T used to overflow the logits' dtype (float16 below T = 1.5e-5, float32
    below 3e-39): every scaled value became -inf or NaN and the draw was junk."""
    x, best = _peaked(dtype)
    s = SeqSampler(Sampling(temperature=temperature, seed=1))
    assert {pick_batch([s], x, [pos])[0][0] for pos in range(20)} == {best}


def _flat():
    return logits(seed=5) / 3  # standard normal logits: many tokens in play


def _draws(n=300, **params):
    """Tokens drawn at positions 0..n-1 from the same logits at temperature 1."""
    s = SeqSampler(Sampling(temperature=1.0, seed=7, **params))
    return [pick_batch([s], _flat(), [pos])[0][0] for pos in range(n)]


def _ranked():
    """Token ids by probability, most likely first, and the probabilities."""
    x = _flat()
    probs = mx.softmax(x, axis=-1)[0]
    return mx.argsort(-probs).tolist(), probs.tolist()


def test_top_k_keeps_only_the_k_most_likely():
    order, _ = _ranked()
    assert len(set(_draws())) > 3
    assert set(_draws(top_k=2)) == set(order[:2])


def test_top_p_keeps_the_smallest_set_reaching_p():
    order, probs = _ranked()
    need = next(i for i in range(V) if sum(probs[t] for t in order[: i + 1]) >= 0.9) + 1
    allowed = set(order[:need])
    got = set(_draws(top_p=0.9))
    assert got <= allowed and len(got) > 1 and got != set(_draws())


def test_min_p_drops_tokens_far_below_the_favourite():
    order, probs = _ranked()
    allowed = {t for t in range(V) if probs[t] >= 0.3 * probs[order[0]]}
    got = set(_draws(min_p=0.3))
    assert got <= allowed and len(got) > 1 and len(allowed) < len(set(_draws()))


def _penalised(history, **params):
    """Greedy pick after ``history`` when token 5 leads token 6 by 0.5."""
    x = mx.zeros((1, V))
    x[0, 5], x[0, 6] = 2.0, 1.5
    s = SeqSampler(Sampling(**params))
    s.observe(history)
    return pick_batch([s], x, [len(history)])[0][0]


def test_presence_penalty_counts_a_token_once():
    assert _penalised([5], presence_penalty=0.4) == 5
    assert _penalised([5, 5, 5], presence_penalty=0.4) == 5   # seen three times: still one penalty
    assert _penalised([5], presence_penalty=0.6) == 6


def test_frequency_penalty_grows_with_each_repeat():
    assert _penalised([5], frequency_penalty=0.3) == 5
    assert _penalised([5, 5], frequency_penalty=0.3) == 6     # 2.0 - 2 x 0.3 < 1.5
    assert _penalised([5, 5], presence_penalty=0.3) == 5
