"""The wire form of the vocabulary: ``Sampling``, ``QuantSpec`` and ``KvQuant`` to and from
their messages in ``pipeline.proto``. The one module of ``params/`` that loads protobuf; the
head writes these messages and the stages read them, both through here."""

from __future__ import annotations

from typing import Optional

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.params.kv import DEFAULT_KV_GROUP_SIZE, KvQuant
from mlxpipe.shards.params.quant import DEFAULT_GROUP_SIZE, QuantSpec
from mlxpipe.shards.params.sampling import Sampling


def sampling_to_wire(s: Sampling) -> pb.SamplingParams:
    p = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p if 0 < s.top_p < 1 else 0.0,  # the wire's 0 is "off"
        top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.repetition_penalty != 1 else 0.0,
        repetition_context_size=s.repetition_context_size,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        penalty_context_size=s.penalty_context_size,
        logprobs=s.logprobs or s.top_logprobs > 0, top_logprobs=s.top_logprobs,
        logit_bias=dict(s.logit_bias), grammar=s.grammar, prompt_logprobs=s.prompt_logprobs,
    )
    if s.seed is not None:
        p.has_seed, p.seed = True, s.seed % (1 << 64)
    return p


def sampling_from_wire(p: pb.SamplingParams) -> Sampling:
    return Sampling(
        temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty or 1.0,
        repetition_context_size=p.repetition_context_size or 20,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        penalty_context_size=p.penalty_context_size or 20,
        seed=p.seed if p.has_seed else None, logprobs=p.logprobs, top_logprobs=p.top_logprobs,
        logit_bias=dict(p.logit_bias), grammar=p.grammar, prompt_logprobs=p.prompt_logprobs,
    )


def quant_to_wire(spec: QuantSpec) -> pb.Quantization:
    return pb.Quantization(bits=spec.bits, group_size=spec.group_size, layer_bits=list(spec.layer_bits or ()))


def quant_from_wire(msg: pb.Quantization) -> Optional[QuantSpec]:
    """None when the message is unset (load the model as it is stored)."""
    if not msg.bits:
        return None
    return QuantSpec(msg.bits, msg.group_size or DEFAULT_GROUP_SIZE, tuple(msg.layer_bits) or None)


def kv_to_wire(kv: KvQuant) -> pb.KvQuantization:
    return pb.KvQuantization(bits=kv.bits, group_size=kv.group_size, start=kv.start)


def kv_from_wire(msg: pb.KvQuantization) -> Optional[KvQuant]:
    return KvQuant.of(msg.bits, msg.group_size or DEFAULT_KV_GROUP_SIZE, msg.start)
