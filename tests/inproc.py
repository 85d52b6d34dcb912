"""A pipeline in one process: the real Scheduler and real StageRuntimes, frames
handed from one to the next by a loop instead of gRPC. For fast tests of the
data path's logic (the end-to-end tests start real processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from mlxpipe.server.scheduler import Scheduler, SchedulerConfig, Sequence as Seq
from mlxpipe.shards.slicing import load_stage
from mlxpipe.shards.stage import ShardLimits, Shard


class InProcess:
    def __init__(self, path: Path, ranges: Sequence[Tuple[int, int]], config: SchedulerConfig, eos=()):
        self.eos = frozenset(eos)
        self.stages = []
        for start, end in ranges:
            model, cfg = load_stage(Path(path), start, end)
            limits = ShardLimits(max_chunk_tokens=config.chunk_size, block_tokens=config.block_tokens)
            self.stages.append(Shard(model, int(cfg["hidden_size"]), int(cfg["vocab_size"]), limits))
        self.scheduler = Scheduler(config)
        self.reset_prefix()
        self._ids = 0

    def reset_prefix(self) -> None:
        """Tell the scheduler what each stage holds now (as a rebuilt pipeline's Load replies do)."""
        held = [list(st.prefix.blocks) if st.prefix else [] for st in self.stages]
        self.scheduler.reset_prefix(held, self.scheduler.config.prefix_blocks)

    def generate(self, prompts: List[List[int]], max_tokens: int, sampling=None) -> Tuple[List[List[int]], List[Seq]]:
        """Greedy (or ``sampling``) tokens of every prompt, run together; and their Sequences."""
        from mlxpipe.shards.sampling import Sampling

        seqs = []
        for p in prompts:
            self._ids += 1
            seqs.append(Seq(seq_id=self._ids, prompt=list(p), max_tokens=max_tokens, eos=self.eos,
                            sampling=(sampling or Sampling(seed=0)).to_wire()))
            self.scheduler.add(seqs[-1])
        out: Dict[int, List[int]] = {s.seq_id: [] for s in seqs}
        while not self.scheduler.idle:
            for frame in self.scheduler.schedule():
                x = frame
                for st in self.stages:
                    x = st.run(x)
                for ev in self.scheduler.on_result(x):
                    out[ev.seq.seq_id].append(ev.token)
        return [out[s.seq_id] for s in seqs], seqs
