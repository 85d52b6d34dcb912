"""A frame refused: what every part of a stage that checks a frame raises, and the gRPC
status the stage answers it with (``Forward`` turns it into that status for the head);
and how a node whose tensor group broke says so in its health (``GROUP_BROKEN``)."""

from __future__ import annotations


class FrameError(ValueError):
    """A frame this stage refuses. ``code`` names the gRPC status to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


# The start of a node's health detail once its tensor group broke: it is about to start
# afresh (shards/worker/servicer.py), and the head waits for it (server/cluster/stage_client.py).
GROUP_BROKEN = "tensor group broken"
