"""Grammar-constrained sequences through real stages in one process: output that
follows the schema, beside unconstrained rows of the same decode group, the same
after a replay, and never speculated; a grammar that fails is its sequence's error."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from inproc import InProcess

from mlxpipe.server.api.structured import response_format_grammar, tokenizer_json
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.shards.models.grammar import tokenizer_from_json
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.sampling import Sampling

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
GRAMMAR = response_format_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})


@pytest.fixture(scope="module")
def tok(chat_model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(chat_model)


def pipeline(chat_model, tok, **config):
    ll = tokenizer_from_json(tokenizer_json(tok), 49152, sorted(tok.eos_token_ids))
    return InProcess(chat_model, [(0, 2), (2, 4)], SchedulerConfig(**config), eos=tok.eos_token_ids, tokenizer=ll)


def prompts(tok, n):
    return [tok.apply_chat_template([{"role": "user", "content": f"Person {i} as JSON"}], add_generation_prompt=True)
            for i in range(n)]


def constrained(seed):
    return Sampling(temperature=1.0, seed=seed, grammar=GRAMMAR)


def test_constrained_rows_follow_the_schema_beside_plain_rows(chat_model, tok):
    ps = prompts(tok, 4)
    alone, _ = pipeline(chat_model, tok, num_groups=1).generate(ps[2:], 12)
    out, seqs = pipeline(chat_model, tok, num_groups=1).generate(
        ps, 60, [constrained(1), constrained(2), None, None])
    validator = jsonschema_rs.validator_for(SCHEMA)
    for tokens, seq in zip(out[:2], seqs):
        assert seq.finish_reason == "stop"  # the grammar completed
        validator.validate(json.loads(tok.decode(tokens)))
    assert [t[:12] for t in out[2:]] == alone  # greedy rows of the same group are untouched


@pytest.mark.parametrize("after", [3, 9])  # while prefilling, while decoding
def test_a_replayed_constrained_sequence_goes_on_where_it_was(chat_model, tok, after):
    ps = prompts(tok, 2)
    want, _ = pipeline(chat_model, tok).generate(ps, 60, [constrained(7), constrained(8)])
    got, _ = pipeline(chat_model, tok).generate(ps, 60, [constrained(7), constrained(8)], replay_after=after)
    assert got == want


def test_constrained_sequences_do_not_speculate(chat_model, tok):
    ps = prompts(tok, 1)
    plain, _ = pipeline(chat_model, tok).generate(ps, 60, [constrained(3)])
    out, seqs = pipeline(chat_model, tok, speculate=True).generate(ps, 60, [constrained(3)])
    assert out == plain and seqs[0].spec_state is None


def test_the_last_stage_refuses_what_it_cannot_enforce(chat_model, tok):
    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.shards.worker.stage import FrameError

    def prefill(grammar):
        entry = pb.SeqEntry(seq_id=1, offset=0, num_tokens=2, sample=True,
                            sampling=wire.sampling_to_wire(constrained(0)))
        entry.sampling.grammar = grammar
        return pb.Frame(frame_id=1, kind=pb.Frame.PREFILL, seqs=[entry], tokens=[1, 2])

    untokenized = InProcess(chat_model, [(0, 4)], SchedulerConfig()).stages[0]
    with pytest.raises(FrameError, match="without a tokenizer") as err:
        untokenized.run(prefill(GRAMMAR))
    assert err.value.code == "FAILED_PRECONDITION"
    single = InProcess(chat_model, [(0, 4)], SchedulerConfig(),
                       tokenizer=pipeline(chat_model, tok).stages[-1].tokenizer).stages[0]
    # A grammar that does not compile is its sequence's failure, not the frame's: an
    # error result for that sequence, and the stage goes on.
    failed = single.run(prefill('{"grammars": [{"lark_grammar": "start: nope"}]}'))
    assert [t.seq_id for t in failed.tokens] == [1] and "its grammar failed" in failed.tokens[0].error
    single.run(prefill(GRAMMAR))
    verify = pb.Frame(frame_id=2, kind=pb.Frame.VERIFY, tokens=[5, 6],
                      seqs=[pb.SeqEntry(seq_id=1, offset=2, num_tokens=2, sample=True)])
    with pytest.raises(FrameError, match="cannot verify drafts"):
        single.run(verify)


def test_a_forced_parallel_call_cut_off_keeps_the_calls_written_whole():
    from mlxpipe.server.api.chat_template import ForcedReply

    reply = ForcedReply([{"name": "get_weather"}, {"name": "get_person"}], parallel=True)
    delta = reply.feed('[{"name": "get_person", "arguments": {"name": "Ada", "age": 36}}, '
                       '{"name": "get_weather", "arguments": {"ci', final=True)
    assert [c["function"]["name"] for c in delta.tool_calls] == ["get_person"]
    assert json.loads(delta.tool_calls[0]["function"]["arguments"]) == {"name": "Ada", "age": 36}
    assert reply.finish_reason("length") == "length" and delta.content == ""
    cut = ForcedReply([{"name": "get_weather"}, {"name": "get_person"}], parallel=True)
    assert cut.feed('[{"name": "get_per', final=True).content == '[{"name": "get_per'


@pytest.fixture(scope="module")
def default_ll(default_model):
    """llguidance's tokenizer of the default model."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(default_model)
    return tokenizer_from_json(tokenizer_json(tok), 49152, sorted(tok.eos_token_ids))


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "object", "properties": {"city": {"type": "string"}}}, '{"city": "Oslo"}', True),
    ({"type": "object", "properties": {"city": {"type": "string"}}}, '{"city": "Oslo", "n": 1}', False),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     '{"city": "Oslo", "n": 1}', True),
    ({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True},
     '{"city": "Oslo", "n": 1}', True),
    ({"type": "object"}, '{"n": 1}', True),  # no properties listed: an open object (json_object's schema)
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
     '{"a": {"b": 1, "c": 2}}', False),  # nested objects are closed too
], ids=["declared", "undeclared key", "extras allowed by a schema", "extras allowed", "no properties", "nested"])
def test_objects_allow_no_undeclared_keys_unless_the_schema_says_so(default_ll, schema, text, ok):
    """Unspecified additionalProperties is false, as xgrammar's strict mode has it."""
    import llguidance as llg

    ll = default_ll
    matcher = llg.LLMatcher(ll, response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}}),
                            log_level=0)
    assert (matcher.consume_tokens(ll.tokenize_str(text)) and matcher.is_accepting()) == ok
