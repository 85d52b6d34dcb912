"""``mlxpipe bench models``: every architecture the installed mlx-lm ships, through the pipeline.

For each model type, a tiny random-weight model (``bench/tiny.py``) runs on real
stage processes at 2 and 3 stages, against single-process mlx-lm's greedy
tokens on the same weights:

- ``plain``: two prompts decoded together (a micro-batch group);
- ``prefix``: the first conversation resent (prompt + answer): it must start from
  cached blocks (``cached_tokens`` > 0) and still equal mlx-lm;
- ``speculation``: one stream with drafts from an oracle that knows mlx-lm's
  answer and gets every fifth position wrong, so drafts are both accepted and
  rejected (every stage takes the rejected positions back);
- ``replay``: a node killed with ``kill -9`` mid-stream and started again; the
  head rebuilds the pipeline and replays the sequence.

The stage processes are a few long-lived ``mlxpipe node`` processes that load
one model after another. Types the stages refuse (``slicing.UNSUPPORTED``)
must answer a Load with their reason; types mlx-lm itself cannot run here
(``tiny.NOT_HERE``) are listed with why. The table is docs/models.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

SCENARIOS = ("plain", "prefix", "speculation", "replay")
NEW_TOKENS = 16
VARIED = 8  # distinct tokens mlx-lm's answer must have, for equality to mean something
REPLAY_TOKENS = 48  # the stream a node is killed under: still live when the kill lands
SECRET = "bench-models-secret-0123456789"


def prompts() -> List[List[int]]:
    """Two prompts longer than the tiny models' sliding windows and several prefix blocks."""
    return [[(i * 7919) % 40000 + 100 for i in range(45)], [(i * 104729) % 40000 + 100 for i in range(30)]]


class Oracle:
    """Drafts from the answer mlx-lm gives, wrong at every fifth position (so that
    some drafts are accepted and some rejected): a draft model's kind of source."""

    source = "draft_model"

    def __init__(self, prompt: Sequence[int], answer: Sequence[int]):
        self.start, self.answer = len(prompt), list(answer)

    def prepare(self, tokens) -> None:
        pass

    def close(self) -> None:
        pass

    def propose(self, tokens, k: int, confirmed: int) -> List[int]:
        at = len(tokens) - self.start
        return [t if i % 5 != 2 else (t + 1) % 1000 + 5 for i, t in enumerate(self.answer[at:at + k], start=at)]


class References:
    """Greedy tokens of single-process mlx-lm (no end-of-sequence stop)."""

    def __init__(self):
        self.models: Dict[str, object] = {}

    def __call__(self, path: Path, prompt: Sequence[int], n: int = NEW_TOKENS) -> List[int]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.utils import load_model

        if str(path) not in self.models:
            self.models[str(path)] = load_model(path)[0]
        return [t for t, _ in generate_step(mx.array(prompt), self.models[str(path)], max_tokens=n)]


class NodePool:
    """Long-lived ``mlxpipe node`` processes on loopback, sharing one models folder."""

    def __init__(self, count: int, models_dir: Path, home: Path):
        self.count, self.models_dir, self.home = count, models_dir, home
        self.procs: List[Optional[subprocess.Popen]] = [None] * count
        self.addresses: List[str] = ["127.0.0.1:0"] * count

    def _spawn(self, i: int) -> None:
        env = dict(os.environ, MLXPIPE_HOME=str(self.home), MLXPIPE_SECRET=SECRET)
        proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.shards.worker.node", "--listen", self.addresses[i],
                                 "--models-dir", str(self.models_dir), "--log-level", "ERROR"],
                                stdout=subprocess.PIPE, text=True, env=env)
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.kill()
            raise RuntimeError(f"node {i} did not start: {line!r}")
        self.procs[i], self.addresses[i] = proc, line.split()[-1]

    def start(self) -> "NodePool":
        for i in range(self.count):
            self._spawn(i)
        return self

    def kill(self, i: int) -> None:
        """``kill -9`` node ``i``, then start it again on the same address."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()
        self._spawn(i)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class Outcome:
    """What one type did at one stage count: scenario -> "ok" or what went wrong."""

    model_type: str
    stages: int
    results: Dict[str, str] = field(default_factory=dict)
    refused: str = ""   # the Load's error, for a type the stages refuse
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(v == "ok" for v in self.results.values())


async def _tokens(stream) -> List[int]:
    return [t.id async for t in stream]


def _cluster_config(path: Path, nodes: List[str]):
    from mlxpipe.proto.rpc import Security
    from mlxpipe.server.config import ClusterConfig
    from mlxpipe.server.core.supervision import Supervision

    return ClusterConfig(model=str(path), nodes=nodes, split="even", chunk_size=8, rejoin_timeout_s=60.0,
                         supervision=Supervision(health_interval_s=0.5, health_timeout_s=1.5),
                         security=Security(secret=SECRET))


async def _scenarios(cluster, path: Path, pool: NodePool, stages: int, ref: References) -> Dict[str, str]:
    engine = cluster.engine
    p1, p2 = prompts()
    r1, r2 = ref(path, p1), ref(path, p2)
    out: Dict[str, str] = {}

    def check(name: str, got: List[int], want: List[int], extra: str = "") -> None:
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out[name] = f"differs at token {at}"
        else:
            out[name] = extra or "ok"

    plain = await asyncio.gather(*(_tokens(engine.submit(p, NEW_TOKENS, stop_at_eos=False)) for p in (p1, p2)))
    first_wrong = next(((g, w) for g, w in zip(plain, (r1, r2)) if g != w), (plain[0], r1))
    varied = len(set(r1)) >= VARIED
    check("plain", *first_wrong, "" if varied else f"mlx-lm's tokens hardly vary ({len(set(r1))} distinct)")
    again = p1 + r1[:-1]
    stream = engine.submit(again, NEW_TOKENS, stop_at_eos=False)
    check("prefix", await _tokens(stream), ref(path, again), "" if stream.cached_tokens else "no cached tokens")
    drafts, drafters = engine.scheduler.drafts, engine.scheduler.speculator.drafters
    judged, accepted = drafts.judged, drafts.accepted
    engine.scheduler.speculator.drafters = lambda seq: Oracle(seq.prompt, r1)
    try:
        got = await _tokens(engine.submit(p1, NEW_TOKENS, stop_at_eos=False))
    finally:
        engine.scheduler.speculator.drafters = drafters
    judged, accepted = drafts.judged - judged, drafts.accepted - accepted
    check("speculation", got, r1, "" if 0 < accepted < judged else f"{accepted} of {judged} drafts accepted")
    out["replay"] = await _replay(cluster, pool, stages, p2, ref(path, p2, REPLAY_TOKENS))
    return out


async def _replay(cluster, pool: NodePool, stages: int, prompt: List[int], want: List[int]) -> str:
    """The last stage's node killed at the stream's first token (the stream is long enough
    to be live then), started again; the head rebuilds and replays."""
    engine = cluster.engine
    recoveries = engine.stats.recoveries
    stream = engine.submit(prompt, len(want), stop_at_eos=False, speculation="none")
    got = []
    async for t in stream:
        got.append(t.id)
        if len(got) == 1:
            await asyncio.to_thread(pool.kill, stages - 1)
    if engine.stats.recoveries == recoveries:
        return "the kill caused no recovery"
    return "ok" if got == want else "differs after the replay"


async def _refusal(path: Path, address: str) -> str:
    """What a node answers a Load of part of a model it must refuse (its first layer)."""
    import grpc

    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
    from mlxpipe.proto.rpc import Security

    security = Security(secret=SECRET)
    async with security.channel(address) as channel:
        try:
            await pb_grpc.StageStub(channel).Load(pb.LoadRequest(model=str(path), start=0, end=1),
                                                  metadata=security.metadata(), timeout=60)
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details()}"
    return ""


async def check_type(model_type: str, path: Path, pool: NodePool, stages: int, ref: References) -> Outcome:
    """All scenarios of one type at ``stages`` stages (or the refusal of its Load)."""
    from mlxpipe.server.cluster.assembly import Cluster
    from mlxpipe.server.core.transport import PipelineError
    from mlxpipe.shards.models.slicing import UNSUPPORTED

    outcome = Outcome(model_type, stages)
    t0 = time.monotonic()
    if model_type in UNSUPPORTED:
        outcome.refused = await _refusal(path, pool.addresses[0])
        return outcome
    try:
        async with Cluster(_cluster_config(path, pool.addresses[:stages])) as cluster:
            outcome.results = await asyncio.wait_for(_scenarios(cluster, path, pool, stages, ref), 240)
    except (PipelineError, ValueError) as err:  # a stage's refusal, or the head's (no valid cut there)
        if isinstance(err, ValueError) and "cannot be cut" not in str(err) and "cannot run as a stage" not in str(err):
            outcome.results = {"error": f"{type(err).__name__}: {err}"}
        else:
            outcome.refused = str(err)
    except Exception as err:  # noqa: BLE001 - a row of the table, whatever broke
        outcome.results = {"error": f"{type(err).__name__}: {err}"}
    outcome.seconds = time.monotonic() - t0
    return outcome


# -- the command ---------------------------------------------------------------------------


def _cell(o: Outcome, scenario: str) -> str:
    if o.refused:
        return "refused"
    v = o.results.get(scenario) or o.results.get("error", "?")
    return "ok" if v == "ok" else f"FAIL ({v})"


def table(outcomes: List[Outcome], not_here: Dict[str, str]) -> str:
    """The matrix as a Markdown table (docs/models.md), and what it adds up to."""
    from mlxpipe.bench import tiny
    from mlxpipe.shards.models.slicing import UNSUPPORTED

    lines = ["| model type | caches | stages | " + " | ".join(SCENARIOS) + " |",
             "| --- | --- | --- |" + " --- |" * len(SCENARIOS)]
    for o in outcomes:
        cells = [_cell(o, s) for s in SCENARIOS]
        lines.append(f"| {o.model_type} | {tiny.cache_kinds(o.model_type)} | {o.stages} | " + " | ".join(cells) + " |")
    types = list(dict.fromkeys(o.model_type for o in outcomes))
    ran = {t: [o for o in outcomes if o.model_type == t and not o.refused] for t in types}
    passed = [t for t in types if ran[t] and all(o.ok for o in ran[t])]
    failed = [t for t in types if any(not o.ok and not o.refused for o in outcomes if o.model_type == t)]
    refused = [o for o in outcomes if o.refused and o.model_type not in UNSUPPORTED]
    lines += ["", f"{len(types)} types: {len(passed)} equal mlx-lm in every scenario wherever they load; "
              f"{len(failed)} fail" + (f" ({', '.join(failed)})" if failed else "") + ".", ""]
    if refused:
        lines += ["Refused at Load for a split (their blocks need more than the hidden state from a block "
                  "another stage holds; other cuts run):", ""]
        lines += [f"- {o.model_type} at {o.stages} stages: {o.refused.split('_ARGUMENT: ')[-1]}" for o in refused]
        lines.append("")
    lines += ["Refused at Load for any cut (a pipeline of one stage runs them; `shards/models/slicing.py` "
              "`UNSUPPORTED`):", ""]
    lines += [f"- {t}: {why}" for t, why in sorted(UNSUPPORTED.items())]
    lines += ["", "Not run here (`bench/tiny.py` `NOT_HERE`):", ""]
    lines += [f"- {t}: {why}" for t, why in sorted(not_here.items())]
    return "\n".join(lines) + "\n"


async def run_matrix(types: Sequence[str], stage_counts: Sequence[int], tokenizer_from: Path,
                     progress=print) -> List[Outcome]:
    """Build every type in ``types`` and run it at each stage count, on one node pool."""
    from mlxpipe.bench import tiny

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="mlxpipe-models-") as tmp:
        pool = NodePool(max(stage_counts), Path(tmp) / "models", Path(tmp) / "home")
        pool.models_dir.mkdir()
        ref = References()
        try:
            pool.start()
            for model_type in types:
                path = tiny.build(model_type, pool.models_dir / model_type, tokenizer_from)
                for stages in stage_counts:
                    outcome = await check_type(model_type, path, pool, stages, ref)
                    outcomes.append(outcome)
                    progress(f"{model_type:24s} {stages} stages  {'ok' if outcome.ok else outcome.refused[:60] or outcome.results}"
                             f"  ({outcome.seconds:.0f} s)")
                ref.models.pop(str(path), None)
        finally:
            pool.stop()
    return outcomes


async def bench_models(args) -> dict:
    import logging

    from mlxpipe.bench import tiny
    from mlxpipe.shards.models.store import resolve_model

    logging.getLogger("mlxpipe.server").setLevel(logging.ERROR)  # each replay's recovery is expected

    types = args.types.split(",") if args.types else [t for t in tiny.model_types() if t not in tiny.NOT_HERE]
    outcomes = await run_matrix(types, [int(s) for s in args.stages.split(",")], resolve_model("default"))
    text = table(outcomes, {t: w for t, w in tiny.NOT_HERE.items() if not args.types or t in types})
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(HEADER + text + "\n" + VISION)
    return {"outcomes": [o.__dict__ for o in outcomes]}


HEADER = """# Model architectures

Every model type the installed mlx-lm ships, as a tiny random-weight model
(`bench/tiny.py`), through the pipeline on real stage processes, against
single-process mlx-lm's greedy tokens on the same weights. Generated by
`mlxpipe bench models --markdown docs/models.md`; see `bench/models.py` for
what each column checks. Caches: P positional (keys and values), R rotating
window, S state-space or linear-attention arrays, L a list of caches, C a
model's own cache class.

"""


# Written after the table: vision-language models, tested apart (tests/test_vision.py).
VISION = """## Vision-language models

With `pip install 'mlxpipe[vision]'` (mlx-vlm), a model folder that mlx-vlm loads and
that holds its vision tower takes images (README, "Images"; docs/ARCHITECTURE.md,
"Images"): the head runs the model's processor and tower, the stages run mlx-vlm's
language model, cut like the types above. Tested against single-process mlx-vlm's
greedy tokens on the same weights, with one and two images, beside a text stream and
again from the prefix cache (`tests/test_vision.py`, tiny random-weight models of
`bench/tiny_vision.py`):

| family (mlx-vlm type) | how an image enters | positions | stages |
| --- | --- | --- | --- |
| qwen2_5_vl | a run of image-pad tokens per image (between vision start and end), one per 2x2 merged patches of its grid | its own: three rotary axes (time, height, width), shifted after each image | 1, 2, 3 |
| gemma3 | `<start_of_image>`, 256 (here 16) `<image_soft_token>`, `<end_of_image>` | the tokens' offsets (mlx-vlm's Gemma 3 attends causally over image tokens too) | 1, 2, 3 |
| mistral3 | rows of `[IMG]` broken by `[IMG_BREAK]`, then `[IMG_END]` (Pixtral) | the tokens' offsets | 1, 2, 3 |

Other mlx-vlm families whose language model takes the first stage's rows and
nothing more (Llava-style towers and projectors, Qwen2-VL, PaliGemma, Idefics) go the
same way untested. Refused with the reason when an image arrives: those whose
language model needs more than the rows at the first stage (Qwen3-VL's deepstack
features added in its first layers, Llama 3.2's cross-attention states). Without
mlx-vlm, such a folder is served as text (mlx-lm's own class of the type, above), and
images get a 400 naming the extra. What mlx-vlm adds to an install, measured on top of
a plain `pip install mlxpipe` (Linux x86_64): about 0.8 GB (1,215 MB against 423 MB: datasets with pandas, pyarrow and
scipy, OpenCV, mlx-audio; its first import takes seconds), so it is an extra; `[test]` installs it.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("models")
    q.add_argument("--types", default=None, help="comma-separated model types (default: all)")
    q.add_argument("--stages", default="2,3", help="stage counts to run each type at (default %(default)s)")
    q.add_argument("--markdown", default=None, help="also write the table to this file (docs/models.md)")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_models)
