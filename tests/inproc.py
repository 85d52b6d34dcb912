"""A pipeline in one process: the real Scheduler (through core/frames.py, as the
engine drives it) and real Shards, frames handed from one to the next by a loop
instead of gRPC. For fast tests of the data path's logic (the end-to-end tests
start real processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlxpipe.server.core.budget import KindTotals
from mlxpipe.server.core.frames import Framer, prompt_scores
from mlxpipe.server.core.prefix_index import model_salt, snapshot_every
from mlxpipe.server.core.scheduler import Scheduler, SchedulerConfig
from mlxpipe.server.core.sequence import Seq
from mlxpipe.shards.cache.disk import DiskTier
from mlxpipe.shards.cache.kinds import kv_switch
from mlxpipe.shards.cache.quantized import KvSwitch
from mlxpipe.shards.models.digest import read_weights
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.slicing import load_stage, warm_up
from mlxpipe.shards.worker.stage import ShardLimits, Shard


class WiredScheduler:
    """A ``Scheduler`` as the engine drives it: its steps through ``core/frames.py``,
    so that tests read the frames the stages get and answer with results. Everything
    else is the scheduler's own."""

    def __init__(self, config: SchedulerConfig, **kw):
        # A decode frame timed (speculation may start) at an hour's round trip: no trial
        # window of speculation ends, so tests of its mechanics see no pause.
        kw.setdefault("costs", lambda: {"decode": KindTotals(frame_s=3600.0)})
        self.core = Scheduler(config, **kw)
        self.framer = Framer(self.core)

    def schedule(self):
        return self.framer.schedule()

    def on_result(self, result):
        return self.framer.on_result(result)

    def __getattr__(self, name):
        return getattr(self.core, name)


class InProcess:
    def __init__(self, path: Path, ranges: Sequence[Tuple[int, int]], config: SchedulerConfig, eos=(),
                 tokenizer=None, kv=None, disk: Optional[Path] = None, disk_bytes: int = 1 << 30):
        """``tokenizer``: llguidance's, for the last stage's grammars; ``kv``: the stages'
        KV quantization (``KvQuant``; the scheduler's ``kv_start`` should be its start);
        ``disk``: where the stages keep the prefix cache's disk tier (each its own, of
        ``disk_bytes``), as ``mlxpipe node`` does under $MLXPIPE_HOME (None: no disk tier)."""
        self.eos = frozenset(eos)
        self.stages = []
        self.footprints = []
        self.kv_ratios = []  # stages that quantize their KV: a full-precision token over a quantized one
        self.digests = []    # what each stage computes with (as its Load reply says: models/digest.py)
        for start, end in ranges:
            model, cfg = load_stage(Path(path), start, end)
            self.digests.append(read_weights(model).result(cfg))
            cfg = with_sizes(cfg.get("text_config", cfg))
            limits = ShardLimits(max_chunk_tokens=config.chunk_size, block_tokens=config.block_tokens)
            footprint = warm_up(model, int(cfg["hidden_size"]))
            switch, kv_bytes, _ = kv_switch(model, int(cfg["hidden_size"]), kv) if kv else (KvSwitch(), 0, "")
            tier = DiskTier(disk, start, end, disk_bytes) if disk is not None and config.block_tokens else None
            self.stages.append(Shard(model, int(cfg["hidden_size"]), int(cfg["vocab_size"]), limits,
                                     tokenizer if model.last else None, switch, tier))
            self.footprints.append(footprint)
            if switch.slots:
                self.kv_ratios.append(footprint.kv_bytes_per_token / kv_bytes)
        self.scheduler = WiredScheduler(config)
        self.scheduler.set_kv(bool(self.kv_ratios), max(self.kv_ratios, default=1.0))
        self.reset_prefix()
        self._ids = 0
        self.scores: Dict[int, Dict[int, tuple]] = {}  # seq id -> position -> (logprob, top): prompt scores

    def reset_prefix(self) -> None:
        """Tell the scheduler what each stage holds now (as a rebuilt pipeline's Load replies do)."""
        held = [list(st.prefix.blocks) if st.prefix else [] for st in self.stages]
        disks = [st.prefix.disk.blocks() if st.prefix is not None and st.prefix.disk is not None else ([], [])
                 for st in self.stages]
        starts = [st.starts() + disk[1] if f.state_bytes else None
                  for st, f, disk in zip(self.stages, self.footprints, disks)]
        every = snapshot_every(self.scheduler.config.block_tokens,
                               [(f.kv_bytes_per_token, f.state_bytes) for f in self.footprints])
        self.scheduler.reset_prefix(held, self.scheduler.config.prefix_blocks, starts, every,
                                    [d[0] for d in disks], self.scheduler.config.prefix_disk_blocks)
        self.scheduler.kv.set_model(model_salt(d.units for d in self.digests), self.scheduler.seqs.values())
        self.scheduler.core.max_rewind = min(st.limits.max_rewind if st.stateful else 1 << 30 for st in self.stages)

    def flush(self) -> None:
        """Wait for the disk tiers' writes (a stage process does it before it exits)."""
        for st in self.stages:
            if st.prefix is not None and st.prefix.disk is not None:
                st.prefix.disk.flush()

    def close(self) -> None:
        """As the stage processes stopping: their disk tiers finish writing and let go."""
        for st in self.stages:
            if st.prefix is not None and st.prefix.disk is not None:
                st.prefix.disk.close()

    def generate(self, prompts: List[List[int]], max_tokens: int, sampling=None,
                 replay_after: int = 0) -> Tuple[List[List[int]], List[Seq]]:
        """Greedy (or ``sampling``: one, or one per prompt) tokens of every prompt, run
        together; and their Sequences. ``replay_after``: after that many results the
        stages lose every sequence and the scheduler replays them (as after a fault)."""
        from mlxpipe.shards.params.sampling import Sampling

        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        seqs = []
        for p, sp in zip(prompts, samplings):
            self._ids += 1
            seqs.append(Seq(seq_id=self._ids, prompt=list(p), max_tokens=max_tokens, eos=self.eos,
                            sampling=sp or Sampling(seed=0)))
            self.scheduler.add(seqs[-1])
        out: Dict[int, List[int]] = {s.seq_id: [] for s in seqs}
        results = 0
        while not self.scheduler.idle:
            for fetch in self.scheduler.take_fetches():  # (the engine asks the stages at once; so do we)
                self.scheduler.fetched(fetch, [st.prefix.fetch(fetch.seq_id, keys) if keys else ([], [])
                                               for st, keys in zip(self.stages, fetch.keys)])
            for frame in self.scheduler.schedule():
                x = frame
                for st in self.stages:
                    x = st.run(x)
                for sc in prompt_scores(x):
                    for i, lp in enumerate(sc.logprobs):
                        self.scores.setdefault(sc.seq_id, {})[sc.start + i] = (lp, sc.top[i] if sc.top else None)
                for ev in self.scheduler.on_result(x):
                    if ev.token >= 0:  # (a sequence that only scored its prompt ends with none)
                        out[ev.seq.seq_id].append(ev.token)
                results += 1
                if results == replay_after:
                    for st in self.stages:
                        st.free_all()
                    self.scheduler.replay_all()
                    break
        return [out[s.seq_id] for s in seqs], seqs
