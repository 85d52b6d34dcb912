"""The stage worker: the node process, its gRPC services, the MLX thread, a stage's sequences and
frames, token choice.
"""
