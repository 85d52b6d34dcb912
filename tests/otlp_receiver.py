"""A tiny OTLP/HTTP trace receiver for tests: POST /v1/traces (protobuf), spans kept as dicts."""

from __future__ import annotations

import threading
import time

from mlxpipe.bench.tracing import Sink


class Receiver(Sink):
    """``bench tracing``'s receiver, keeping every span it gets."""

    def __init__(self):
        self.spans: list = []  # dicts: trace_id, span_id, parent_id (hex), name, start, end (ns), attrs
        self._lock = threading.Lock()
        super().__init__(keep=self._keep)

    def _keep(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        request = ExportTraceServiceRequest.FromString(body)
        with self._lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(_span(s) for s in ss.spans)

    def trace(self, trace_id: str, until: str = "", timeout: float = 30.0) -> list:
        """The spans of one trace received so far, once one named ``until`` is among them."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if (not until or any(s["name"] == until for s in spans)) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _span(s) -> dict:
    def value(v):
        return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

    return {"trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(), "parent_id": s.parent_span_id.hex(),
            "name": s.name, "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
            "attrs": {a.key: value(a.value) for a in s.attributes}}
