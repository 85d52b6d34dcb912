"""The model drafts for itself: MTP heads read from the checkpoint, drafting on the last stage,
verified through the pipeline. Greedy tokens stay mlx-lm's (MTP off); sampled ones keep their
distribution.

The tiny models carry MTP heads under their checkpoint's own names (``conftest.mtp_models``):
DeepSeek-V3's layer after the last (with its copies of the embedding and head), Qwen3-Next's
``mtp.*`` beside its linear-attention layers, MiMo's ``model.mtp_layers.*``; each head trained
for a few seconds on the model's own greedy continuations of the test prompts
(``bench/mtp_head.py``), so that its drafts are often right and every path (hits, misses,
trims of state caches) runs.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import MTP_PROMPTS
from inproc import InProcess

from mlxpipe.server.core.drafting import Either, PromptLookup, StageDrafts
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.shards.models import mtp_layout
from mlxpipe.shards.models.weights import model_units, range_unit_names, unit_of, units_for_range
from mlxpipe.shards.params.kv import KvQuant
from mlxpipe.shards.params.sampling import Sampling

PROMPTS = MTP_PROMPTS[:3] + [[15, 3, 3004, 90, 428, 57]]  # (the heads never saw the last one: misses too)
NEW = 24


# -- names, units, drafts: pure ------------------------------------------------------------


def test_each_layout_names_the_head_and_the_units_carry_it():
    cases = [("model.layers.61.enorm.weight", "layers", mtp_layout.Name(0, "enorm", "weight")),
             ("model.layers.61.shared_head.norm.weight", "layers", mtp_layout.Name(0, "out_norm", "weight")),
             ("model.layers.61.mlp.experts.3.up_proj.weight", "layers", mtp_layout.Name(0, "block", "mlp.experts.3.up_proj.weight")),
             ("model.layers.62.eh_proj.weight_scale_inv", "layers", mtp_layout.Name(1, "proj", "weight_scale_inv")),
             ("model.mtp_layers.1.input_proj.weight", "mtp_layers", mtp_layout.Name(1, "proj", "weight")),
             ("model.mtp_layers.0.self_attn.q_proj.bias", "mtp_layers", mtp_layout.Name(0, "block", "self_attn.q_proj.bias")),
             ("mtp.fc.weight", "mtp", mtp_layout.Name(-1, "proj", "weight")),
             ("mtp.pre_fc_norm_hidden.weight", "mtp", mtp_layout.Name(-1, "hnorm", "weight")),
             ("mtp.layers.0.mlp.gate.weight", "mtp", mtp_layout.Name(0, "block", "mlp.gate.weight"))]
    for name, layout, want in cases:
        assert mtp_layout.classify(name, 61) == want
        assert mtp_layout.checkpoint_name(layout, 61, want) == name
    assert mtp_layout.classify("model.layers.60.mlp.gate.weight", 61) is None  # the model's own last layer
    assert mtp_layout.classify("model.layers.61.embed_tokens.weight", 61).role == "copy"
    assert mtp_layout.classify("model.layers.61.shared_head.head.weight", 61).role == "copy"
    assert unit_of("model.layers.61.eh_proj.weight", 61) == "mtp"
    assert unit_of("model.layers.61.shared_head.head.weight", 61) == "unused"  # the copies never travel
    assert unit_of("model.layers.60.eh_proj.weight", 61) == "layer-00060"
    assert unit_of("mtp.layers.0.self_attn.q_proj.weight") == "mtp"  # (not layer 0's)
    assert range_unit_names(40, 61, 61, False, mtp=True)[-3:] == ["embed", "head", "mtp"]
    assert range_unit_names(0, 40, 61, False, mtp=True)[-1] == "embed"
    assert "mtp" not in range_unit_names(40, 61, 61, False)


def test_stage_drafts_follow_the_tokens_they_were_made_after():
    d = StageDrafts()
    assert d.propose([1, 2, 3], 2, 3) == []
    d.offered(3, [7, 8])  # guesses of the tokens after [1, 2, 3]
    assert d.propose([1, 2, 3], 2, 3) == [7, 8]
    assert d.propose([1, 2, 3, 7], 2, 4) == [8]      # the first guess was right
    assert d.propose([1, 2, 3, 9], 2, 4) == []       # ... or not
    assert d.propose([1, 2, 3, 7, 8], 2, 5) == []    # used up
    either = Either(PromptLookup(), d)
    assert either.mtp and either.propose([1, 2, 3], 1, 3) == [7] and either.source == "mtp"
    either = Either(PromptLookup(), StageDrafts())  # where the text repeats, lookup answers first
    assert either.propose([5, 6, 1, 2, 3, 5, 6], 1, 7) == [1] and either.source == "prompt_lookup"


def test_a_head_loads_from_each_layout_and_a_checkpoint_without_one_says_so(mtp_models):
    from mlxpipe.shards.models.mtp import load_mtp
    from mlxpipe.shards.models.slicing import load_stage

    for kind, layers in (("deepseek_v3", 1), ("qwen3_next", 1), ("mimo", 2)):
        base, with_mtp = mtp_models(kind, random_layers=layers)
        n = json.loads((base / "config.json").read_text())["num_hidden_layers"]
        stage, config = load_stage(with_mtp, n - 1, n)  # the main model loads without the head's tensors
        head, note = load_mtp(with_mtp, stage.model, config)
        assert head is not None and not note and head.layers_found == layers, (kind, note)
        none, why = load_mtp(base, stage.model, config)
        assert none is None and why.startswith("its checkpoint has no MTP weights")
        units = units_for_range(model_units(with_mtp), n - 1, n, n, mtp=True)
        assert {u.name for u in units} >= {"embed", "head", "mtp"}


def test_the_published_layout_in_fp8_loads_through_mlx_lms_sanitize_and_quantizes_with_the_rest(sources, tmp_path):
    """DeepSeek-V3's layer 61 as published (FP8 blocks with ``weight_scale_inv``, per-expert weights,
    ``kv_b_proj``), here the tiny source's last layer again: its block loads into mlx-lm's class as the
    main model's last layer does (dequantized, stacked, split alike), and ``--bits 4`` quantizes it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tiny_models import add_hf_mtp

    from mlxpipe.shards.models.mtp import load_mtp
    from mlxpipe.shards.models.quantize import quantize_mtp
    from mlxpipe.shards.models.slicing import load_stage
    from mlxpipe.shards.params.quant import QuantSpec

    path = add_hf_mtp(sources("dsv3-fp8"), tmp_path / "fp8-mtp")
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    stage, config = load_stage(path, n - 1, n)
    head, note = load_mtp(path, stage.model, config)
    assert head is not None, note
    mine, theirs = dict(tree_flatten(head.layer.block.parameters())), dict(tree_flatten(stage.blocks[-1].parameters()))
    assert mine.keys() == theirs.keys()
    assert all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    quantize_mtp(head, stage.model, config, QuantSpec("4"))
    assert "scales" in dict(head.layer.block.mlp.switch_mlp.up_proj.items())
    z = head(mx.zeros((3, head.layer.enorm.weight.shape[0])), [5, 6, 7], 0, head.make_cache())
    assert head.logits(z).shape[-1] == config["vocab_size"]


# -- equality in one process ------------------------------------------------------------------


def _config(stages: int, **kw) -> SchedulerConfig:
    return SchedulerConfig(chunk_size=8, speculate=True, spec_depth=4, spec_positions=1, num_groups=stages,
                           spec_max_running=4, spec_frames=max(stages, 2), **kw)


def _equal(kind, ranges, mtp_models, reference, prompts=PROMPTS, **kw):
    base, path = mtp_models(kind)
    pipe = InProcess(path, ranges, _config(len(ranges), **{k: v for k, v in kw.items() if k == "block_tokens"}),
                     mtp="mtp", **{k: v for k, v in kw.items() if k != "block_tokens"})
    together, _ = pipe.generate(prompts, NEW)
    alone, _ = pipe.generate(prompts[:1], NEW)
    want = [reference(base, p, NEW, kw.get("kv_ref")) for p in prompts]
    assert together == want and alone == want[:1]
    return pipe


@pytest.mark.parametrize("kind,ranges", [
    ("deepseek_v3", [(0, 2), (2, 4)]),  # the core test: it trains the head the other default tests share
    pytest.param("qwen3_next", [(0, 1), (1, 5), (5, 6)], marks=pytest.mark.extended)])  # (builds a model: ~25 s)
def test_mtp_drafts_leave_greedy_tokens_as_mlx_lms(kind, ranges, mtp_models, reference):
    pipe = _equal(kind, ranges, mtp_models, reference)
    by = pipe.scheduler.drafts.by_source["mtp"]
    assert by[1] > 0 and by[0] > by[1], "drafts both hit and missed (every path ran)"


@pytest.mark.parametrize("kind", ["deepseek_v3",  # (its MLA caches stay at full precision: no KV switch)
                                  pytest.param("qwen3_next", marks=pytest.mark.extended)])  # 8-bit KV, state caches
def test_mtp_with_kv8_after_a_prefix_hit_and_after_a_replay(kind, mtp_models, reference):
    base, path = mtp_models(kind)
    n, kv = (4, None) if kind == "deepseek_v3" else (6, (8, 32, 0))
    pipe = InProcess(path, [(0, n // 2), (n // 2, n)], _config(2, block_tokens=8, prefix_blocks=64, kv_start=0),
                     kv=KvQuant.of(*kv) if kv else None, mtp="mtp")
    assert bool(pipe.kv_ratios) == bool(kv), "the stages' KV caches are quantized where asked"
    # (one the head learned from, with a whole prefix block: its drafts are often right there)
    prompt = MTP_PROMPTS[3] if kind == "deepseek_v3" else PROMPTS[0] + PROMPTS[3] + PROMPTS[1]
    want = reference(base, prompt, NEW, kv)
    (first,), _ = pipe.generate([prompt], NEW)
    (hit,), (seq,) = pipe.generate([prompt], NEW)  # starts after the cached blocks: its MTP cache after them
    assert seq.cached_tokens and first == hit == want
    (replayed,), _ = pipe.generate([prompt + [5]], NEW, replay_after=8)
    assert replayed == reference(base, prompt + [5], NEW, kv)
    assert pipe.scheduler.drafts.by_source["mtp"][1] > 0


def test_sampled_tokens_with_a_seed_are_the_same_with_mtp(mtp_models):
    _, path = mtp_models("deepseek_v3")
    sampling = Sampling(temperature=1.0, seed=11)
    with_mtp = InProcess(path, [(0, 4)], _config(1), mtp="mtp").generate(PROMPTS, NEW, sampling)[0]
    plain = InProcess(path, [(0, 4)], SchedulerConfig(chunk_size=8)).generate(PROMPTS, NEW, sampling)[0]
    assert with_mtp == plain


@pytest.mark.extended  # every family at 1, 2 and 3 stages: CI's second run
@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next", "mimo"])
def test_every_family_at_1_2_and_3_stages(kind, mtp_models, reference):
    n = 4 if kind == "deepseek_v3" else 6
    for ranges in ([(0, n)], [(0, n // 2), (n // 2, n)], [(0, 1), (1, n - 1), (n - 1, n)]):
        _equal(kind, ranges, mtp_models, reference)


def _chi2_p(table) -> float:
    """The p-value of a two-sample chi-square test of the rows' counts (categories expected fewer
    than 5 times merged into one), by the Wilson-Hilferty approximation of the chi-square tail."""
    import math

    rows = sorted(table, key=sum, reverse=True)
    total = [sum(c[j] for c in rows) for j in range(2)]
    big = [r for r in rows if min(sum(r) * t / sum(total) for t in total) >= 5]
    small = [r for r in rows if r not in big]
    if small:
        big.append([sum(r[j] for r in small) for j in range(2)])
    if len(big) < 2:
        return 1.0
    n = sum(total)
    stat = sum((r[j] - sum(r) * total[j] / n) ** 2 / (sum(r) * total[j] / n) for r in big for j in range(2))
    k = len(big) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.extended  # 2 x 150 sampled requests
def test_sampled_output_keeps_its_distribution_at_temperature_1(mtp_models):
    """Independent samples (different seeds) with MTP drafting and without: the tokens they pick at
    each of the positions after the first (where drafts were verified) pass a two-sample chi-square
    test."""
    _, path = mtp_models("deepseek_v3")
    runs, counts = 150, {}
    for name, pipe in (("mtp", InProcess(path, [(0, 2), (2, 4)], _config(2), mtp="mtp")),
                       ("off", InProcess(path, [(0, 2), (2, 4)], SchedulerConfig(chunk_size=8, num_groups=2)))):
        for i in range(runs):
            seed = i if name == "mtp" else runs + i
            (out,), _ = pipe.generate([PROMPTS[1]], 5, Sampling(temperature=1.0, top_k=3, seed=seed))
            for pos, t in enumerate(out):
                counts.setdefault((pos, t), {"mtp": 0, "off": 0})[name] += 1
        if name == "mtp":
            judged, accepted = pipe.scheduler.drafts.by_source["mtp"]
            assert judged > runs and accepted > 0, "the sampled runs were drafted, and drafts were taken"
    assert _chi2_p([[40, 60], [60, 40]]) < 0.01 < _chi2_p([[50, 52], [48, 50]])  # (the test itself)
    for pos in range(1, 5):
        table = [[c["mtp"], c["off"]] for (p, _), c in counts.items() if p == pos]
        assert _chi2_p(table) > 0.001, f"position {pos}: {table}"


@pytest.mark.extended  # a stage killed and restarted under a drafting stream
def test_kill_9_while_drafting_with_the_head(mtp_models, reference):
    """One stream drafting with the model's MTP head; stage 1 killed with drafts in flight: the
    replay (its MTP cache built again from the replayed prefill) gives mlx-lm's tokens."""
    import os
    import signal

    from conftest import run_async

    from mlxpipe.server.cluster.assembly import Cluster
    from mlxpipe.server.config import ClusterConfig
    from mlxpipe.server.core.supervision import Supervision

    base, path = mtp_models("deepseek_v3")

    async def main():
        cfg = ClusterConfig(model=str(path), stages=2, split="even", speculation="mtp",
                            supervision=Supervision(health_interval_s=0.5, health_timeout_s=1.5))
        async with Cluster(cfg) as cluster:
            drafts = cluster.engine.scheduler.drafts
            got, at_fault = [], None
            async for t in cluster.engine.submit(PROMPTS[0], 48):
                got.append(t.id)
                if at_fault is None and drafts.accepted >= 4 and cluster.engine.scheduler.solo:
                    at_fault = (drafts.judged, len(got))
                    os.kill(cluster.local.procs[1].pid, signal.SIGKILL)
            return got, at_fault, cluster.engine.stats.recoveries, drafts.judged

    got, at_fault, recoveries, judged = run_async(main(), timeout=300)
    assert at_fault is not None and at_fault[1] < len(got) - 8, "the fault must land while drafting"
    assert recoveries == 1 and got == reference(base, PROMPTS[0], 48)
    assert judged > at_fault[0], "the replayed sequence drafts with the head again"


@pytest.mark.extended  # two empty nodes receive the model, the last one its MTP head too
def test_a_node_without_the_model_receives_the_head_and_drafts(mtp_models, reference, tmp_path):
    from conftest import SECRET, node_process, run_async

    from mlxpipe.proto.rpc import Security
    from mlxpipe.server.cluster.assembly import Cluster
    from mlxpipe.server.config import ClusterConfig
    from mlxpipe.server.core.streams import collect

    base, path = mtp_models("deepseek_v3")
    nodes = [node_process(tmp_path / f"home{i}") for i in range(2)]

    async def main():
        cfg = ClusterConfig(model=str(path), nodes=[a for _, a in nodes], split="even", speculation="mtp",
                            security=Security(secret=SECRET))
        async with Cluster(cfg) as cluster:
            out = [t.id for t in await collect(cluster.engine.submit(PROMPTS[0], NEW))]
            return out, [(st.start, st.end, st.weights_sent) for st in cluster.pipeline.stages], \
                cluster.pipeline.stages[-1].load.mtp_layers, cluster.engine.scheduler.drafts.by_source

    try:
        out, stages, layers, drafts = run_async(main(), timeout=240)
        assert out == reference(base, PROMPTS[0], NEW) and layers == 1 and drafts["mtp"][1] > 0
        units = model_units(path)
        for start, end, sent in stages:
            assert sent == sum(u.data_bytes for u in units_for_range(units, start, end, 4, mtp=True))
        assert stages[-1][2] > sum(u.data_bytes for u in units_for_range(units, 2, 4, 4)), "the head travelled"
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()


# -- serve ---------------------------------------------------------------------------------------


def test_serve_drafts_with_the_head_and_reports_its_acceptance(mtp_models):
    from server_proc import ServerProcess

    _, path = mtp_models("deepseek_v3")
    srv = ServerProcess("--model", str(path), "--stages", "1", "--temp", "0", "--max-tokens", str(NEW))
    try:
        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": NEW, "speculation": "mtp"}
        usage = httpx.post(f"{srv.base_url}/completions", json=body, timeout=120).json()["usage"]
        assert usage["speculation"]["mtp"]["drafted_tokens"] > 0
        assert usage["completion_tokens_details"]["accepted_prediction_tokens"] == \
            usage["speculation"]["mtp"]["accepted_tokens"] > 0
        health = httpx.get(f"{srv.root}/health", timeout=10).json()
        assert health["speculation"]["mtp"]["loaded"] and health["speculation"]["mtp"]["acceptance"] > 0
        metrics = httpx.get(f"{srv.root}/metrics", timeout=10).text
        assert 'mlxpipe_draft_acceptance{source="mtp"}' in metrics
    finally:
        srv.stop()


def test_serve_on_a_checkpoint_without_a_head_says_so_once(default_server):
    health = httpx.get(f"{default_server.root}/health", timeout=10).json()
    assert health["speculation"]["mtp"] == {"loaded": False, "note": "its checkpoint has no MTP weights",
                                            "acceptance": None}
    r = httpx.post(f"{default_server.base_url}/completions", timeout=60,
                   json={"model": "default", "prompt": "Hi", "max_tokens": 2, "speculation": "mtp"})
    assert r.status_code == 400 and "no MTP head" in r.text
