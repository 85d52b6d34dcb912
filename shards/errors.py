"""What a stage answers a frame it refuses."""

from __future__ import annotations


class FrameError(ValueError):
    """A frame this stage refuses. ``code`` names the gRPC status to answer with."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code
