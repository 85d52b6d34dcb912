"""Speculative decoding with a draft model the head runs (``--draft-model``),
through real stage processes: output equals mlx-lm's whatever the draft
guesses; guesses that agree are accepted, and wrong ones are rolled back."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import types
from pathlib import Path

import pytest
from conftest import PROMPTS, SECRET, node_process, run_async
from faultproxy import FaultProxy

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.draft_model import DraftModelError, load_draft_model
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.server.core.supervision import Supervision
from mlxpipe.shards.params.sampling import Sampling

NEW_TOKENS = 32


def _chat(path, contents):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    return [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in contents]


@contextlib.contextmanager
def _slow_link_nodes(models_dir, stages: int, delay: float = 0.03, with_procs: bool = False):
    """``stages`` node processes, the first behind a proxy that holds every chunk
    ``delay`` seconds: a pipeline step slower than the draft model's step, as
    between Macs a large model and a network hop apart (the tiny models here
    step in milliseconds). Yields the addresses in pipeline order (and, with
    ``with_procs``, the node processes)."""
    procs, addresses = [], []
    proxy = None
    home = tempfile.mkdtemp(prefix="mlxpipe-node-home-")
    try:
        for _ in range(stages):
            proc, address = node_process(Path(home), "--models-dir", str(models_dir))
            procs.append(proc)
            assert address, proc.stderr.read()
            addresses.append(address)
        host, port = addresses[0].rsplit(":", 1)
        proxy = FaultProxy(host, host, int(port))
        proxy.set(delay=delay)
        nodes = [proxy.address] + addresses[1:]
        yield (nodes, procs) if with_procs else nodes
    finally:
        if proxy is not None:
            proxy.close()
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(home, ignore_errors=True)


async def _run(model, draft, stages, prompts, rounds, sampling=Sampling()):
    """Each prompt, each ``speculation`` of ``rounds``, alone in turn (speculation is
    for few streams) over ``stages`` nodes: the tokens of each, and the drafted and
    accepted counts of each (differences of the engine's running totals)."""
    with _slow_link_nodes(model.parent, stages) as nodes:
        cfg = ClusterConfig(model=str(model), nodes=nodes, split="even", draft_model=str(draft),
                            security=Security(secret=SECRET))
        async with Cluster(cfg) as cluster:
            out = []
            for prompt in prompts:
                for speculation in rounds:
                    before = cluster.engine.speculation()
                    tokens = await collect(cluster.engine.submit(prompt, NEW_TOKENS, sampling,
                                                                 speculation=speculation))
                    after = cluster.engine.speculation()
                    out.append(([t.id for t in tokens], {k: after[k] - before[k]
                                                         for k in ("drafted_tokens", "accepted_tokens")}))
            return out


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_draft_model_that_agrees_is_accepted_and_tokens_equal_mlx_lm(stages, dsv3_model, reference):
    """The tiny DeepSeek-V3 drafting for itself: every guess right. By itself and
    after prompt lookup ("auto")."""
    (prompt,) = _chat(dsv3_model, PROMPTS[1:2])
    want = reference(dsv3_model, prompt, NEW_TOKENS)
    (model_only, after_model), (auto, _) = run_async(
        _run(dsv3_model, dsv3_model, stages, [prompt], ["draft_model", "auto"]))
    assert model_only == want and auto == want, f"{stages} stages diverged from mlx-lm with a draft model"
    assert after_model["accepted_tokens"] > 0, after_model
    assert after_model["accepted_tokens"] == after_model["drafted_tokens"], "a draft of the same model was rejected"


@pytest.fixture(scope="module")
def dsv3_3bit(tmp_path_factory, default_model):
    """The tiny DeepSeek-V3's weights at 3 bits: a draft that agrees about half the time."""
    from tiny_models import build_deepseek_v3

    return build_deepseek_v3(tmp_path_factory.mktemp("dsv3-3bit") / "model", default_model, bits=3)


def test_a_draft_model_that_is_partly_wrong_is_rolled_back(dsv3_model, dsv3_3bit, reference):
    """Guesses judged right are taken, the first wrong one is replaced by the sampled
    token and what was sent after it is trimmed on every stage: mlx-lm's answer."""
    prompts = _chat(dsv3_model, PROMPTS)
    got = run_async(_run(dsv3_model, dsv3_3bit, 2, prompts, ["draft_model"]))
    for prompt, (tokens, _) in zip(prompts, got):
        assert tokens == reference(dsv3_model, prompt, NEW_TOKENS), "a rejected draft changed the answer"
    drafted = sum(after["drafted_tokens"] for _, after in got)
    accepted = sum(after["accepted_tokens"] for _, after in got)
    assert 0 < accepted < drafted, f"drafts were not both accepted and rejected: {accepted} of {drafted}"


def test_sampled_output_is_the_same_with_a_draft_model(dsv3_model, reference):
    """A seed reproduces the text with and without drafts: the last stage samples each
    verified position with the key plain decoding would use, and a greedy draft is
    taken only where the sample equals it (the accept/reject rule for a draft that
    puts all its probability on one token), so the distribution is unchanged."""
    (prompt,) = _chat(dsv3_model, PROMPTS[2:3])
    sampling = Sampling(temperature=0.05, seed=11)  # cool enough that greedy drafts are often sampled
    (plain, _), (drafted, after) = run_async(
        _run(dsv3_model, dsv3_model, 2, [prompt], ["none", "draft_model"], sampling))
    assert plain != reference(dsv3_model, prompt, NEW_TOKENS), "sampling never left the greedy path"
    assert drafted == plain
    assert after["accepted_tokens"] > 0, after


@pytest.mark.extended  # (a kill while verifying: test_faults in the default run)
def test_kill_9_of_a_node_while_verifying_model_drafts(dsv3_model, reference):
    """A node dies with drafts in flight: drafters of the lost pipeline are closed
    (their running job's answer is dropped), the sequence replays on the nodes left
    and drafts again, and the answer is mlx-lm's."""
    (prompt,) = _chat(dsv3_model, PROMPTS[:1])

    async def main():
        with _slow_link_nodes(dsv3_model.parent, 3, with_procs=True) as (nodes, procs):
            cfg = ClusterConfig(model=str(dsv3_model), nodes=nodes, split="even", draft_model=str(dsv3_model),
                                security=Security(secret=SECRET), rejoin_timeout_s=1.0,
                                supervision=Supervision(health_interval_s=0.5, health_timeout_s=1.5))
            async with Cluster(cfg) as cluster:
                drafts = cluster.engine.scheduler.drafts
                got, judged, at = [], None, 0
                async for t in cluster.engine.submit(prompt, 2 * NEW_TOKENS, speculation="draft_model"):
                    got.append(t.id)
                    if judged is None and drafts.accepted >= 4 and cluster.engine.scheduler.solo:
                        judged, at = drafts.judged, len(got)  # drafts are in flight now
                        procs[2].kill()
                return got, judged, at, cluster.engine.stats.recoveries, drafts.judged, len(cluster.pipeline.stages)

    got, judged_at_fault, at, recoveries, judged, stages = run_async(main(), timeout=240)
    assert judged_at_fault is not None and at < len(got) - 8, "the fault must land while speculating"
    assert recoveries == 1 and stages == 2
    assert got == reference(dsv3_model, prompt, 2 * NEW_TOKENS)
    assert judged > judged_at_fault, "the replayed sequence drafts again"


def test_a_draft_model_with_another_tokenizer_is_refused(dsv3_model):
    other = types.SimpleNamespace(get_vocab=lambda: {"<s>": 0, "a": 1})
    with pytest.raises(DraftModelError, match="another tokenizer"):
        load_draft_model(str(dsv3_model), other)


def test_asking_for_a_draft_model_the_server_lacks_is_refused(dsv3_model):
    async def main():
        async with Cluster(ClusterConfig(model=str(dsv3_model), stages=1)) as cluster:
            with pytest.raises(ValueError, match="no draft model"):
                cluster.engine.submit([1, 2, 3], 4, speculation="draft_model")
            with pytest.raises(ValueError, match="speculation must be one of"):
                cluster.engine.submit([1, 2, 3], 4, speculation="psychic")
            # "none" decodes without drafts even where the prompt repeats itself.
            tokens = await collect(cluster.engine.submit([5, 6, 7] * 10, 8, speculation="none"))
            return len(tokens), cluster.engine.speculation()

    n, spec = asyncio.run(asyncio.wait_for(main(), 300))
    assert n == 8 and spec["drafted_tokens"] == 0 and "draft_model" not in spec
