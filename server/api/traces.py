"""OpenTelemetry traces of API requests (``serve --otlp-endpoint``, or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), over OTLP/HTTP.

One trace per API request: the HTTP server span (a client's W3C ``traceparent``
honoured: the span is its child, in its trace), and under it one "generate" span per
stream the request ran, with its wait in the queue, every prefill chunk, decode and
verify step (and, under each, the wire's hops and each stage's span with its queued,
decode, compute and encode parts), and the head's time between them, as the engine
recorded them (``core/tracing.py``). Spans are built after the response is sent, in
a worker thread, and the SDK's batch processor exports them; nothing here runs, and
the OpenTelemetry SDK (the ``otel`` extra) is not imported, while tracing is off.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from typing import List, Optional

from mlxpipe.server.core.tracing import RequestTrace, Span

logger = logging.getLogger(__name__)

TRACED_PATHS = ("/v1/", "/api/", "/messages")  # the APIs (not /health, /metrics, the page)
_current: contextvars.ContextVar[Optional[List[RequestTrace]]] = contextvars.ContextVar("mlxpipe_traces",
                                                                                         default=None)
_EPOCH_NS = time.time_ns() - time.perf_counter_ns()  # perf_counter seconds -> Unix nanoseconds


def new_trace() -> Optional[RequestTrace]:
    """A trace for one stream of the request being served, or None when it is not traced."""
    traces = _current.get()
    if traces is None:
        return None
    trace = RequestTrace()
    traces.append(trace)
    return trace


def endpoint(given: Optional[str]) -> Optional[str]:
    """Where traces go: ``--otlp-endpoint`` (a collector's base URL, or its ``/v1/traces``),
    else the standard variables (None: tracing is off)."""
    if given:
        return given if given.rstrip("/").endswith("/v1/traces") else given.rstrip("/") + "/v1/traces"
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


class Exporter:
    """The OpenTelemetry SDK's tracer, its batch processor and OTLP/HTTP exporter."""

    def __init__(self, url: str, service: str = "mlxpipe"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as err:
            raise ValueError(f"--otlp-endpoint needs the OpenTelemetry SDK: pip install 'mlxpipe[otel]' ({err})") \
                from None
        self.url = url
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url),
                                                            schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("mlxpipe")

    def emit(self, name: str, headers: dict, start: float, end: float, attrs: dict,
             traces: List[RequestTrace]) -> None:
        """The HTTP span of one request (``start``/``end``: perf_counter seconds) and, under
        it, each stream's engine spans."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(headers)  # the client's traceparent, if any
        http = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=_ns(start),
                                      attributes=attrs)
        inside = trace.set_span_in_context(http)
        for t in traces:
            self._span(t.span(end), inside)
        http.end(end_time=_ns(end))

    def _span(self, span: Span, context) -> None:
        from opentelemetry import trace

        otel = self.tracer.start_span(span.name, context=context, start_time=_ns(span.start), attributes=span.attrs)
        if span.children:
            inside = trace.set_span_in_context(otel)
            for child in span.children:
                self._span(child, inside)
        otel.end(end_time=_ns(span.end))

    def close(self) -> None:
        self.provider.shutdown()  # (exports what is queued)


def _ns(seconds: float) -> int:
    return _EPOCH_NS + int(seconds * 1e9)


class Traces:
    """ASGI middleware: one trace per API request, exported after the response is sent."""

    def __init__(self, app, exporter: Exporter):
        self.app, self.exporter = app, exporter

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(TRACED_PATHS):
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), None
        traces: List[RequestTrace] = []

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = _current.set(traces)
        try:
            await self.app(scope, receive, watch)
        finally:
            _current.reset(token)
            end = time.perf_counter()
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
            attrs = {"http.request.method": scope.get("method", ""), "url.path": path,
                     "http.response.status_code": status or 0}
            name = f"{scope.get('method', '')} {path}"
            try:
                await asyncio.to_thread(self.exporter.emit, name, headers, start, end, attrs, traces)
            except Exception:  # noqa: BLE001 - a trace never fails a request
                logger.exception("building the trace of %s", name)
