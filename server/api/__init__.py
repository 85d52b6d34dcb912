"""The HTTP API: one module per protocol over one internal request (``request.py``, ``generation.py``)."""
