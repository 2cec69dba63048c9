"""A real OTLP/gRPC trace service on loopback for tests that read back what a server exports,
and the W3C traceparent a client sends."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace service on 127.0.0.1: keeps every span it is sent, with the
    `service.name` of its resource."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, trace_pb2.Span]] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:  # the generated servicer names it
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((resource.get("service.name", ""), s) for s in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes, names: set[str], timeout: float = 30) -> dict[str, trace_pb2.Span]:
        """The spans of `trace_id` by name, once every one of `names` has arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = {s.name: s for _, s in self.spans if s.trace_id == trace_id}
            if names <= set(found) or time.monotonic() > deadline:
                assert names <= set(found), f"missing {sorted(names - set(found))}; got {sorted(found)}"
                return found
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.stop(0)


def new_traceparent() -> tuple[str, bytes, bytes]:
    """A W3C traceparent of a new trace, sampled: (header, trace id, the parent span id)."""
    trace_id, span_id = os.urandom(16), os.urandom(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    """A span's attributes as Python values."""
    found: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        found[a.key] = getattr(a.value, kind) if kind else None
    return found
