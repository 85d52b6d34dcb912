"""The planner on a live cluster: stages time the model, the head balances the split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import SECRET, run_async, stage_stub

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.local import LocalStages
from mlxpipe.server.config import ClusterConfig

CONFIGS = Path(__file__).parent / "configs"


def test_stage_profiles_the_model_and_caches_it(default_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path))  # a fresh profile cache
    local = LocalStages(1, SECRET, default_model.parent)
    (address,) = local.start()
    try:
        stub = stage_stub(address)
        first = stub.Profile(pb.ProfileRequest(model=str(default_model), batch=4), timeout=300)
        assert len(first.layer_seconds) == 30 and not first.cached
        assert min(first.layer_seconds) > 0
        # The tied 49,152-row head costs more than one of the 30 layers.
        assert first.head_seconds > max(first.layer_seconds)
        assert first.memory_bytes > 1 << 30
        # Prefill per prompt token, timed in a chunk: one per layer, less than a step of 4 rows.
        assert first.prefill_tokens == 128 and len(first.prefill_layer_seconds) == 30
        assert 0 < max(first.prefill_layer_seconds) < min(first.layer_seconds)
        again = stub.Profile(pb.ProfileRequest(model=str(default_model), batch=4), timeout=60)
        assert again.cached and list(again.layer_seconds) == list(first.layer_seconds)
        assert list(tmp_path.glob("profiles/*-b4.json"))
    finally:
        local.stop()


def test_planned_split_weighs_the_head_against_the_workloads_prefill(default_model):
    """Balanced for decode alone, the last stage (which carries the output head) gets fewer
    layers; balanced for a chat workload's prompt tokens too (the default), where a prompt
    token costs about what a decoded one does (this CPU), it gets more of them back."""
    async def main(ratio):
        async with Cluster(ClusterConfig(model=str(default_model), stages=2, prompt_ratio=ratio)) as cluster:
            return [(s.start, s.end) for s in cluster.pipeline.stages], cluster.plan_note

    decode, note = run_async(main(0.0))
    (a0, a1), (b0, b1) = decode
    assert a0 == 0 and a1 == b0 and b1 == 30
    assert b1 - b0 < a1 - a0, f"the last stage carries the head: {decode}"
    assert "planned" in note and "prompt chunks" not in note
    mixed, note = run_async(main(10.0))  # (the default before a workload was measured)
    assert mixed[1][1] - mixed[1][0] > b1 - b0, (decode, mixed)
    assert "prompt chunks, for 10 prompt tokens per generated token" in note and "per prompt token" in note


def test_plan_command_needs_no_weights():
    out = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "plan", "--model",
                          str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x512GB", "--bits", "4", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["feasible"] and plan["num_layers"] == 61
    stages = plan["stages"]
    assert stages[0]["start"] == 0 and stages[-1]["end"] == 61
    assert all(a["end"] == b["start"] for a, b in zip(stages, stages[1:]))
    small = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "plan", "--model",
                            str(CONFIGS / "deepseek_v3.json"), "--nodes", "2x64GB", "--bits", "4"],
                           capture_output=True, text=True, timeout=60)
    assert small.returncode == 2 and "short" in small.stderr
