"""The head's core: requests to frames and back (scheduling, KV budget, prefix index, speculation,
the engine); no HTTP, no gRPC, and only ``frames.py`` touches the wire."""
