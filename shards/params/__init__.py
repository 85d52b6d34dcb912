"""The vocabulary head and stages agree on: sampling parameters, quantization specs, KV settings,
sizes.

Pure Python: no module here but ``wire.py`` loads MLX, protobuf or gRPC.
"""
