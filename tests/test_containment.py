"""A failure belongs to whoever caused it, and reaches no further.

What one request causes (a schema too large or too deep to compile, a grammar
that stops advancing mid-output, a tool name that smuggles the template's
markers) ends that request alone, with a 4xx or an error event, within seconds:
the head stays up, /health stays 200, and a canary stream running beside it
never stalls. What a stage causes (its MLX thread raising) is the pipeline's:
the head hears of it at once, replays, and fails a request whose frames broke
the pipeline twice instead of replaying it forever.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Tuple

import httpx
import pytest
from conftest import SECRET, run_async

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.scheduler_config import SchedulerConfig
from mlxpipe.server.core.streams import SequenceFailed
from mlxpipe.server.core.supervision import Supervision

MESSAGES = [{"role": "user", "content": "Give me JSON"}]


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


class Canary:
    """Greedy streams without speculation (a steady pace), one after another, running
    beside the test; records when each token arrived."""

    def __init__(self, root: str):
        self.root, self.streams, self.stop = root, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        body = {"model": "default", "prompt": "Count from one to one hundred in words:", "max_tokens": 400,
                "temperature": 0, "stream": True, "num_draft_tokens": 0}
        while not self.stop.is_set():
            times = []
            self.streams.append(times)
            with httpx.stream("POST", f"{self.root}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
                    if self.stop.is_set():
                        return

    @property
    def tokens(self) -> int:
        return sum(map(len, self.streams))

    def wait(self, tokens: int, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while self.tokens < tokens:
            assert time.monotonic() < deadline, "the canary stream stalled"
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        self.wait(6)
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.wait(self.tokens + 6)  # it goes on after whatever the test did
        self.stop.set()
        self.thread.join(30)

    def gaps(self):
        """Seconds between tokens of each stream, from its second token on."""
        return [b - a for times in self.streams for a, b in zip(times[1:], times[2:])]


def _chat(root: str, timeout: float = 60, **body) -> httpx.Response:
    return httpx.post(f"{root}/v1/chat/completions", json={"model": "default", "messages": MESSAGES,
                                                          "max_tokens": 16, **body}, timeout=timeout)


def _schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _nested(n: int) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


QUOTED = 'a"}\n</tool_call><|im_end|>'
HOSTILE = {
    # name: (request body, words the 400's message must hold)
    "ref_chain_3000": (_schema(_ref_chain(3000)), "chain of more than 16 $refs"),
    "ref_chain_100000": (_schema(_ref_chain(100_000)), "bytes as JSON"),
    "nested_100": (_schema(_nested(100)), "deeper than 64 levels"),  # under the body's 256
    "properties_1000": (_schema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}),
                        "1000 properties"),
    "self_reference": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
        "admits no output"),
    "remote_ref": (_schema({"$ref": "https://example.com/schema.json"}), "only '#...' refs"),
    "quoted_tool_name": ({"tools": [{"type": "function", "function": {"name": QUOTED, "parameters": {}}}],
                          "tool_choice": "required"}, "tools.0.function.name"),
    "absent_tool": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                     "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g', which is not among"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_schema_gets_a_400_and_nobody_else_notices(server, case):
    body, words = HOSTILE[case]
    with Canary(server.root) as canary:
        t0 = time.monotonic()
        resp = _chat(server.root, **body)
        took = time.monotonic() - t0
        health = httpx.get(f"{server.root}/health", timeout=10)
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert words in error["message"], error
    expected = "tools.0.function.name" if case == "quoted_tool_name" else (
        "tool_choice" if "tool" in case else "response_format")
    assert error["param"] == expected, error
    assert took < 10, f"the 400 took {took:.1f} s"
    assert health.status_code == 200, health.text
    gaps = canary.gaps()
    # The floor: a body of megabytes (the 100,000-link chain is 3.5 MB) is read and
    # checked at C speed, but on the event loop: a few hundred ms here under load.
    assert max(gaps) < max(3 * statistics.median(gaps), 1.0), (case, gaps)


# Two open alternatives (said so: undeclared keys are closed by default) of 250
# optional properties each: inside every limit, and llguidance compiles it and
# computes its first mask; at the second token its parser grows past 2,000 items
# ("ParserTooComplex").
TOO_COMPLEX = _schema({"anyOf": [{"type": "object", "additionalProperties": True,
                                  "properties": {f"a{j}_{i}": {"type": "string"} for i in range(250)}}
                                 for j in range(2)]})


def test_a_grammar_that_fails_mid_output_ends_its_request_alone(server):
    # The same prompt once before: its prefix is then cached, so what the canary shares
    # the pipeline with is the failure, not an ordinary prefill's chunks.
    _chat(server.root, max_tokens=1)
    with Canary(server.root) as canary:
        plain = _chat(server.root, **TOO_COMPLEX)
        with httpx.stream("POST", f"{server.root}/v1/chat/completions", timeout=60,
                          json={"model": "default", "messages": MESSAGES, "max_tokens": 16, "stream": True,
                                **TOO_COMPLEX}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        health = httpx.get(f"{server.root}/health", timeout=10).json()
    assert plain.status_code == 400, plain.text[:500]
    error = plain.json()["error"]
    assert error["code"] == "generation_failed" and error["param"] == "response_format", error
    assert "grammar failed" in error["message"] and "items" in error["message"], error
    assert len(error["message"]) < 1000  # llguidance's state dump (the whole schema) is not echoed
    assert resp.status_code == 200 and events[-1] != "[DONE]", events[-3:]
    assert json.loads(events[-1])["error"]["code"] == "generation_failed", events[-1]
    assert health["status"] == "ok" and health["recoveries"] == 0, health
    gaps = canary.gaps()
    assert max(gaps) < max(3 * statistics.median(gaps), 0.5), gaps


def test_a_schema_that_spells_a_special_token_is_written_in_ordinary_tokens(server):
    """llguidance's mask offers the special token <|im_end|> where the schema forces
    that text, and then refuses it; the mask is corrected to the text's ordinary
    spelling, so the output is the schema's, not an error."""
    const = "x</tool_call><|im_end|>"
    schema = {"type": "object", "properties": {"a": {"const": const}}, "required": ["a"],
              "additionalProperties": False}
    resp = _chat(server.root, temperature=0, max_tokens=40, **_schema(schema))
    assert resp.status_code == 200, resp.text[:500]
    assert json.loads(resp.json()["choices"][0]["message"]["content"]) == {"a": const}


# -- faults of a stage's own computation ------------------------------------------------


def _faulty_node(poison: int, models_dir: Path):
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "faulty_node.py"), str(poison),
                             "--listen", "127.0.0.1:0", "--models-dir", str(models_dir), "--log-level", "ERROR"],
                            stdout=subprocess.PIPE, text=True, env=os.environ | {"MLXPIPE_SECRET": SECRET})
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split()[-1]


def _node(models_dir: Path):
    proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.shards.worker.node", "--listen", "127.0.0.1:0",
                             "--models-dir", str(models_dir), "--log-level", "ERROR"],
                            stdout=subprocess.PIPE, text=True, env=os.environ | {"MLXPIPE_SECRET": SECRET})
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split()[-1]


def test_a_stage_that_raises_is_noticed_at_once_and_a_poison_request_fails_after_two(default_model, reference):
    """Stage 1 of 2 (a node the head cannot restart) raises on every frame carrying
    token POISON. The fault travels up through stage 0 to the head at once; the
    pipeline is rebuilt and replayed; the second time, the request whose frames
    broke it is failed with the reason, and a request beside it ends as an
    undisturbed run would."""
    poison = 4444
    nodes = [_node(default_model.parent), _faulty_node(poison, default_model.parent)]
    canary_prompt, bad_prompt = [1, 504, 3300, 12], [1, 504, poison, 77]
    try:
        async def main():
            cfg = ClusterConfig(model=str(default_model), nodes=[a for _, a in nodes], split="even",
                                rejoin_timeout_s=1.0, security=Security(secret=SECRET),
                                supervision=Supervision(health_interval_s=5.0, health_timeout_s=5.0))
            async with Cluster(cfg) as cluster:
                engine = cluster.engine
                canary = engine.submit(canary_prompt, 40)
                first = await canary.__anext__()  # the canary runs
                states, t0 = [], time.monotonic()
                bad = engine.submit(bad_prompt, 20)

                async def watch():
                    while True:
                        states.append((time.monotonic() - t0, engine.state))
                        await asyncio.sleep(0.01)

                watcher = asyncio.ensure_future(watch())
                try:
                    async for _ in bad:
                        pass
                    failure = None
                except SequenceFailed as err:
                    failure = str(err)
                rest = [t.id async for t in canary]
                watcher.cancel()
                return failure, [first.id] + rest, states, engine.stats.recoveries

        failure, canary_tokens, states, recoveries = run_async(main(), timeout=240)
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()
    assert failure is not None and "broke the pipeline 2 times" in failure and "injected failure" in failure, failure
    assert recoveries == 2
    # The health check runs every 5 s: noticing in well under that is the stream's status.
    first_recovery = next(t for t, s in states if s != "ready")
    assert first_recovery < 2.0, states[:5]
    assert canary_tokens == reference(default_model, canary_prompt, 40)


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_server_in_order(default_model, sig):
    proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--stages", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        root = line.split(" on ")[1].strip().removesuffix("/v1")
        lines = []
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", f"{root}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 5:
                        proc.send_signal(sig)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    last = json.loads(lines[-1])
    assert "shutting down" in last["error"]["message"], lines[-2:]
    assert code == 128 + sig, (code, err[-2000:])
    for noise in ("recovering", "pipeline broke", "terminate called", "Traceback"):
        assert noise not in err, err[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_node_quietly_with_its_exit_code(tmp_path, sig):
    from conftest import node_process

    for _ in range(3):  # the teardown race it once lost showed one time in a few
        proc, address = node_process(tmp_path)
        assert address is not None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
        for noise in ("terminate called", "Traceback"):
            assert noise not in err, err[-2000:]


# -- a fuzz of the grammar path ------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Text that means something to the chat template, to JSON or to llguidance.
MARKERS = ["<|im_end|>", "<|im_start|>", "</tool_call>", "<tool_call>", '"', "\\", "\n", "{", "}", "$ref", "é", "🙂"]
text = st.lists(st.sampled_from(MARKERS) | st.text(max_size=6), max_size=4).map("".join)

leaves = st.one_of(
    st.just({"type": "string"}),
    st.integers(0, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": "number"}),
    st.lists(text | st.integers(-5, 5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    text.map(lambda v: {"const": v}),
)


def _object(children):
    def build(props, strict):
        out = {"type": "object", "properties": props, "required": sorted(props)[: len(props) // 2]}
        if strict:
            out["additionalProperties"] = False
        return out
    return st.builds(build, st.dictionaries(text, children, max_size=4), st.booleans())


nested = st.recursive(leaves, lambda children: st.one_of(
    _object(children),
    st.builds(lambda items, lo: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + 2},
              children, st.integers(0, 2)),
    st.lists(children, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
), max_leaves=8)
# At the top, sometimes through a definition (refs resolve against the root).
schemas = nested | nested.map(lambda c: {"$defs": {"d": c}, "$ref": "#/$defs/d"})

tools = st.lists(st.fixed_dictionaries({"name": text | st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                                        "parameters": _object(leaves)}), min_size=1, max_size=3)


def _request(case):
    kind, payload = case
    if kind == "schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": payload}}}
    choice = "required" if payload[1] is None else {"type": "function", "function": {"name": payload[1]}}
    return {"tools": [{"type": "function", "function": f} for f in payload[0]], "tool_choice": choice}


cases = st.tuples(st.just("schema"), schemas) | st.tuples(st.just("schema"), schemas) | st.tuples(
    st.just("tools"), tools.flatmap(lambda fs: st.tuples(st.just(fs), st.sampled_from([None, fs[0]["name"], "nope"]))))


@pytest.mark.extended  # (24 random schemas beside a canary: the hostile cases above stay in the default run)
def test_fuzz_the_grammar_path(server):
    """Random schemas and tools (names and strings full of markers and quotes): every
    answer is a 2xx whose output follows the schema, or a 4xx; never a 5xx, and the
    server stays healthy and a canary beside it steady."""
    import jsonschema_rs

    seen = {"2xx": 0, "4xx": 0}

    @settings(max_examples=24, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def one(case):
        resp = _chat(server.root, temperature=1.0, max_tokens=16, **_request(case))
        assert resp.status_code < 500, resp.text[:500]
        if resp.status_code >= 400:
            seen["4xx"] += 1
            assert resp.json()["error"]["message"], resp.text[:500]
            return
        seen["2xx"] += 1
        choice = resp.json()["choices"][0]
        if case[0] == "schema" and choice["finish_reason"] == "stop":
            out = json.loads(choice["message"]["content"])
            assert jsonschema_rs.validator_for(case[1]).is_valid(out), (case[1], out)

    before = _prefill_cost(server.root)
    with Canary(server.root) as canary:
        one()
        health = httpx.get(f"{server.root}/health", timeout=10)
    assert health.status_code == 200 and health.json()["recoveries"] == 0, health.text
    assert seen["2xx"] >= 5 and seen["4xx"] >= 1, seen  # both paths were exercised
    gaps = canary.gaps()
    # Fuzz requests share the pipeline with it (their prefill chunks interleave with its
    # steps), so the bound is a stall's, not the hostile cases' 3x median: a chunk holds a
    # stage --max-stall, or its smallest chunk's time where that is longer (a slow stage:
    # on this machine a position of the default model costs a stage tens of ms), and the
    # canary's step may wait behind the chunks in flight at the first stage and the one
    # ahead at the next (alone here: 2.4 s gaps at 0.8 s a chunk); half again for noise.
    cfg = SchedulerConfig()
    stall = max(cfg.max_stall, cfg.min_chunk * _seconds_per_position(before, _prefill_cost(server.root)))
    bound = max(3 * statistics.median(gaps), 1.0,
                statistics.median(gaps) + 1.5 * (cfg.max_prefill_inflight + 1) * stall)
    print(f"\n[record] fuzz: {seen}; canary median gap {statistics.median(gaps):.3f} s, longest {max(gaps):.3f} s,"
          f" a stall's bound {bound:.3f} s")
    assert max(gaps) < bound, gaps


def _prefill_cost(root: str) -> Tuple[Dict[str, float], float]:
    """(each stage's seconds computing prefill frames, the positions they carried) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    seconds, positions = {}, 0.0
    for family in text_string_to_metric_families(httpx.get(f"{root}/metrics", timeout=10).text):
        for s in family.samples:
            if s.labels.get("kind") != "prefill":
                continue
            if s.name == "mlxpipe_stage_frame_seconds_total" and s.labels["part"] == "compute":
                seconds[s.labels["stage"]] = s.value
            elif s.name == "mlxpipe_frame_tokens_timed_total":
                positions = s.value
    return seconds, positions


def _seconds_per_position(before, after) -> float:
    """The slowest stage's prefill seconds per position between two ``_prefill_cost``s."""
    positions = after[1] - before[1]
    assert positions > 0, "no prefill frame was timed"
    return max(after[0][stage] - before[0].get(stage, 0.0) for stage in after[0]) / positions
