"""The platform boundary (shards/models/metal.py): which MLX calls a stage makes, with which values.

Driven by a fake of the few calls it makes (``MlxCalls``): nothing here pretends to run
Metal. On this machine (no Metal) the real calls make it a no-op."""

from __future__ import annotations

import pytest

from mlxpipe.shards.models.metal import CLOSE, MIN_CACHE, Metal, MlxCalls

GB = 1 << 30


class FakeMlx(MlxCalls):
    """Records calls; answers as MLX does (a setter returns the limit it replaced)."""

    def __init__(self, available=True, info=None):
        self.available = available
        self.info = {"max_recommended_working_set_size": 100 * GB} if info is None else info
        self.wired, self.cache = 0, 150 * GB
        self.calls = []

    def metal_available(self):
        return self.available

    def device_info(self):
        return dict(self.info)

    def set_wired_limit(self, n):
        self.calls.append(("set_wired_limit", n))
        old, self.wired = self.wired, n
        return old

    def set_cache_limit(self, n):
        self.calls.append(("set_cache_limit", n))
        old, self.cache = self.cache, n
        return old

    def synchronize(self):
        self.calls.append(("synchronize",))


def _metal(fake):
    exits = []
    return Metal(fake, at_exit=exits.append), exits


def test_a_shard_is_wired_its_cache_capped_and_both_restored():
    fake = FakeMlx()
    metal, exits = _metal(fake)
    assert metal.settle(40 * GB, 20 * GB, "layers [0, 30)") == ""  # 60 of 100 GB: no warning
    assert fake.calls == [("set_wired_limit", 100 * GB), ("set_cache_limit", 40 * GB)]
    assert exits == [metal.restore]  # restored at exit
    # Another shard (a re-plan): the wire stays, the cache cap follows the new shard.
    fake.calls.clear()
    metal.settle(70 * GB, 25 * GB, "layers [0, 40)")
    assert fake.calls == [("set_cache_limit", 5 * GB)] and len(exits) == 1
    fake.calls.clear()
    metal.settle(80 * GB, 30 * GB, "layers [0, 50)")  # nothing left beside the shard: the floor
    assert fake.calls == [("set_cache_limit", MIN_CACHE)]
    fake.calls.clear()
    metal.restore()
    assert fake.calls == [("synchronize",), ("set_wired_limit", 0), ("set_cache_limit", 150 * GB)]
    fake.calls.clear()
    metal.restore()  # twice: nothing more
    assert fake.calls == []


def test_close_to_the_working_set_warns_with_the_figures():
    metal, _ = _metal(FakeMlx())
    warning = metal.settle(80 * GB, 12 * GB, "layers [30, 61)")
    assert warning.startswith("layers [30, 61): 85.9 GB of weights + 12.9 GB of KV budget")
    assert "107.4 GB this Mac's GPU may wire" in warning and "iogpu.wired_limit_mb" in warning
    assert metal.settle(80 * GB, 10 * GB - 1, "x") == ""  # 90% of the working set is still fine


def test_default_budget_stays_under_the_working_set():
    metal, _ = _metal(FakeMlx())
    assert metal.budget(150 * GB) == int(CLOSE * 100 * GB)
    assert metal.budget(50 * GB) == 50 * GB


@pytest.mark.parametrize("fake", [FakeMlx(available=False), FakeMlx(info={"device_name": "cpu"})],
                         ids=["no Metal", "no working set reported"])
def test_without_metal_everything_is_a_no_op(fake):
    metal, exits = _metal(fake)
    assert metal.settle(80 * GB, 30 * GB, "layers [0, 4)") == ""
    assert metal.budget(123) == 123
    metal.restore()
    assert fake.calls == [] and exits == []


def test_this_machine_without_metal_makes_no_call():
    metal = Metal()  # the real MLX calls
    if metal.available:
        pytest.skip("this machine has Metal: the fakes above cover the calls")
    assert metal.working_set() is None and metal.settle(1, 1, "x") == "" and metal.budget(7) == 7


def test_mlxpipe_status_shows_a_stage_memory_warning(monkeypatch):
    """Load's reply carries the warning; the head's /health passes it on; `mlxpipe status` prints it."""
    from mlxpipe.server.cli import status

    health = {"model": "m", "status": "ok", "state": "ready", "stages": [
        {"stage": 0, "address": "a:1", "layers": [0, 30], "state": "ready"},
        {"stage": 1, "address": "b:1", "layers": [30, 61], "state": "ready",
         "memory_warning": "layers [30, 61): close"}]}

    class Reply:
        def json(self):
            return health

    monkeypatch.setattr(status, "get_head", lambda url, key, path: Reply())
    out = status.from_head("http://head")
    assert out.endswith("\nstage 1: layers [30, 61): close") and out.count("close") == 1


def test_local_stages_get_a_core_each_by_default_where_there_is_one(monkeypatch):
    """What `serve` starts is what the benches measure: pinned where every local stage
    has a core of its own (as every Mac of a cluster is its own machine), left to the
    OS where they would have to share; --pin/--no-pin decide otherwise."""
    import os

    from mlxpipe.server.cluster import local

    monkeypatch.setattr(local, "available_cpus", lambda: [4, 5])
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: None, raising=False)
    assert local.placement(2, None) == [4, 5]
    assert local.placement(3, None) is None
    assert local.placement(3, True) == [4, 5] and local.placement(2, False) is None
    monkeypatch.delattr(os, "sched_setaffinity")  # macOS: nothing to pin with
    assert local.placement(2, None) is None
