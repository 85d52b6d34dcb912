"""The split the measured workload implies, and what it would gain.

The head counts what it sends (``core/workload.py``): prompt positions computed
after the prefix cache, decode rows (tokens generated, and the concurrency they
ran at), verified positions. The planner balances a decode step of
``profile_batch`` rows plus ``prompt_ratio`` prompt tokens per generated one; the
measured mix becomes that ratio (``effective_ratio``: at the concurrency measured,
a step of fewer rows costs less, by the profile's ``row_cost``). ``mlxpipe status``
shows the mix, the split it implies and the gain predicted for it; a re-plan, and
the next start (the figure is kept per model under ``$MLXPIPE_HOME/workload``),
use it unless ``--prompt-ratio`` says otherwise. Live layers are not moved.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List, Optional

from mlxpipe.server.cluster import planner
from mlxpipe.shards.models.store import mlxpipe_home

logger = logging.getLogger(__name__)


def effective_ratio(mix: Dict[str, float], row_cost: float, batch: int) -> float:
    """The planner's prompt ratio (per generated token of a ``batch``-row step) for the measured mix."""
    c = max(mix.get("concurrency") or 1.0, 1.0)
    f = (1 + row_cost * (c - 1)) / (1 + row_cost * (batch - 1))  # a c-row step's cost, of a batch-row one
    return mix["prompt_ratio"] * c / (f * batch)


def _file(fingerprint: str) -> Path:
    return mlxpipe_home() / "workload" / f"{fingerprint}.json"


def save(fingerprint: str, mix: Dict[str, float]) -> None:
    path = _file(fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mix))


def load(fingerprint: str) -> Optional[Dict[str, float]]:
    try:
        return json.loads(_file(fingerprint).read_text())
    except (OSError, ValueError):
        return None


def report(placer, ranges: List[tuple], addresses: List[str], mix: Dict[str, float], enough: bool,
           configured: Optional[float]) -> dict:
    """The measured mix, the split it implies over these nodes and the predicted gain (``status``)."""
    out = {"measured": mix, "enough": enough, "prompt_ratio_configured": configured,
           "lines": [_mix_line(mix, placer.ratio()[0], configured)]}
    measured = placer.measured_nodes(addresses)
    if not enough or measured is None:
        out["lines"].append("the split it implies: not yet (a few hundred generated tokens, and nodes the head "
                            "timed, are needed)")
        return out
    cost, nodes = measured
    ratio = effective_ratio(mix, placer.row_cost, placer.config.profile_batch)
    work = planner.Workload(ratio, placer.config.chunk_size)
    kw = dict(context=placer.context, concurrency=placer.config.concurrency, workload=work)
    cuts = None if placer.model.cuts.all_valid else placer.model.cuts.valid
    try:
        implied = planner.plan(cost, nodes, every_node=placer.local, cuts=cuts, **kw)
    except planner.PlanInfeasible as err:
        out["lines"].append(f"the split it implies: none fits ({err})")
        return out
    decode_only = planner.plan(cost, nodes, every_node=placer.local, cuts=cuts,
                               **dict(kw, workload=planner.Workload(0, placer.config.chunk_size)))
    out["decode_only"] = decode_only.ranges
    prob = planner._Problem(cost, nodes, kw["context"], kw["concurrency"], 0.0, work)
    now = max(prob.time(i, s, e) for i, (s, e) in enumerate(ranges))
    best = max(prob.time(st.node_index, st.start, st.end) for st in implied.stages)
    out.update(implied=implied.ranges, gain=now / best - 1 if best else 0.0, effective_ratio=ratio)
    layers = " / ".join(str(e - s) for s, e in implied.ranges)
    running = " / ".join(str(e - s) for s, e in ranges)
    out["lines"].append(f"the split it implies: layers {layers} (running: {running}): the slowest stage "
                        f"{out['gain']:.1%} faster per step of this mix; a restart or re-plan uses it"
                        + (" (--prompt-ratio overrides it now)" if configured is not None else ""))
    out["lines"].append("the decode-only split: layers " + " / ".join(str(e - s) for s, e in decode_only.ranges))
    return out


def _mix_line(mix: Dict[str, float], ratio_now: float, configured: Optional[float]) -> str:
    return (f"measured workload (half-life 10 min): {mix['prompt_computed']:.0f} prompt tokens computed of "
            f"{mix['prompt_sent']:.0f} sent ({mix['cached_share']:.0%} from the prefix cache), "
            f"{mix['decode_rows']:.0f} generated in decode steps of {mix['concurrency']:.1f} rows, "
            f"{mix['verify_positions']:.0f} verified positions: {mix['prompt_ratio']:.2f} prompt-like positions "
            f"per generated token; the running split was balanced for {ratio_now:g}"
            + (" (--prompt-ratio)" if configured is not None else ""))
