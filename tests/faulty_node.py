"""A real stage worker (``python -m mlxpipe.shards.worker.node`` with its own arguments)
whose MLX thread fails on every frame that carries one token id: a fault of the
stage's own computation, for tests of how far such a fault reaches (the frame's
sequences take the blame, the head notices at once, replays, and fails a
sequence whose frames broke the pipeline twice).

    python tests/faulty_node.py POISON_TOKEN --listen ... (node arguments)
"""

from __future__ import annotations

import sys

from mlxpipe.shards.worker import node, stage

POISON = int(sys.argv.pop(1))
_launch = stage.Shard.launch


def launch(self, frame, *args, **kwargs):
    if POISON in frame.tokens:
        raise RuntimeError(f"injected failure: frame {frame.frame_id} carries token {POISON}")
    return _launch(self, frame, *args, **kwargs)


stage.Shard.launch = launch

if __name__ == "__main__":
    node.main()
