"""The workload the head measures: prompt tokens computed after the prefix cache, decode rows,
verified positions; the split it implies, shown by `mlxpipe status`, and kept for a restart."""

from __future__ import annotations

import asyncio
import math

from conftest import run_async

from mlxpipe.server.cluster import mix
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.plan import Entry, Opening, Step, StepKind
from mlxpipe.server.core.streams import collect
from mlxpipe.server.core.workload import WorkloadMeter
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.params.sampling import Sampling


def test_the_meter_counts_computed_prompt_tokens_rows_and_verified_positions_and_forgets_slowly():
    m = WorkloadMeter(half_life_s=100)
    opening = Opening(Sampling(), reuse=[1, 2], context=[], generated=[])
    m.step(Step(1, StepKind.PREFILL, [Entry(1, 32, 16, False, opening=opening)]), now=0)  # 32 from the cache
    m.step(Step(2, StepKind.PREFILL, [Entry(1, 48, 8, True)]), now=0)
    for _ in range(4):
        m.step(Step(3, StepKind.DECODE, [Entry(i, 60, 1, True) for i in range(3)]), now=0)
    m.step(Step(4, StepKind.VERIFY, [Entry(1, 70, 4, True)]), now=0)
    got = m.mix()
    assert got["prompt_computed"] == 24 and got["prompt_sent"] == 56 and got["decode_rows"] == 12
    assert math.isclose(got["prompt_ratio"], (24 + 4) / 12) and got["concurrency"] == 3.0
    assert math.isclose(got["cached_share"], 1 - 24 / 56)
    m.step(Step(5, StepKind.DECODE, [Entry(0, 61, 1, True)]), now=100)  # a half-life later
    assert math.isclose(m.mix()["decode_rows"], 12 / 2 + 1, abs_tol=0.1) and m.total["decode_rows"] == 13


def test_effective_ratio_weighs_the_rows_a_step_really_has():
    m = {"prompt_ratio": 4.0, "concurrency": 8.0}
    assert math.isclose(mix.effective_ratio(m, 1.0, 8), 4.0)         # the profile's own batch: as measured
    one = {"prompt_ratio": 4.0, "concurrency": 1.0}
    assert math.isclose(mix.effective_ratio(one, 1.0, 8), 4.0)       # rows cost in proportion: the same
    assert math.isclose(mix.effective_ratio(one, 0.0, 8), 0.5)       # rows free: a 1-row step costs an 8-row one


def test_status_shows_the_measured_mix_its_split_and_a_restart_plans_with_it(dsv3_model):
    """A cluster that served mostly prefill reports the measured mix and the split it implies;
    the next start (no --prompt-ratio) is planned for that mix, and says so."""
    prompt = list(range(100, 400))

    async def serve_some():
        cfg = ClusterConfig(model=str(dsv3_model), stages=2, max_running=8)
        async with Cluster(cfg) as cluster:
            streams = [cluster.engine.submit([7 + i, *prompt], 40) for i in range(8)]
            await asyncio.gather(*map(collect, streams))
            report = cluster.report()["workload"]
            return report, cluster.plan_note

    # Other tests of the session served this model too: the first start must find no workload saved.
    mix._file(fingerprint(dsv3_model)).unlink(missing_ok=True)
    report, note = run_async(serve_some())
    measured = report["measured"]
    assert measured["decode_rows"] >= 256 and report["enough"], report
    assert measured["prompt_computed"] > 8 * 280, report   # every prompt computed (no shared whole block here)
    assert "measured workload" in report["lines"][0] and "the split it implies: layers" in report["lines"][1]
    assert "implied" in report and report["gain"] >= 0 and "the decode-only split: layers" in report["lines"][2]
    assert "(the default)" in note
    _, note = run_async(serve_some())
    assert "(the workload measured)" in note, note
