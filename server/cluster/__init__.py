"""Assembling a pipeline and keeping it up: the config tree, the model, stage processes, the gRPC
stage client, weights, planning, rebuilding."""
