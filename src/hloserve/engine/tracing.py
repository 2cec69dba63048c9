"""OpenTelemetry traces of inferences: one span tree per request, parented by the client's W3C
`traceparent`.

Off unless `tracing.exporter` (or `OTEL_TRACES_EXPORTER`) says `otlp`: then `open_tracing`
returns None, the OpenTelemetry SDK is never imported, and a request pays one None check per
phase. On, a request's phases are marked with `time.monotonic_ns()` as it goes and turned into
spans with those times when it ends, so the dispatcher only fills an `EngineTrace` (plain numbers)
and never calls the SDK on its loop. A request the sampler leaves out makes its root (a
non-recording span, whose context still travels to the engine) and nothing more. Each worker
(and each frontend process) has its own tracer provider; nothing global is set.

The tree of a request served in one process::

    ModelInfer (SERVER; parent: the client's traceparent)
      decode, admission, preprocess?, queue, weight_load?, execute (one per execution),
      postprocess?, encode, reply

With frontends the frontend's `ModelInfer` has a `link` span (CLIENT) in place of the engine's
phases; its context travels in the link's `Run` message and the engine's `engine` span (SERVER)
holds queue, weight_load and execute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hloserve.actors.messages import EngineTrace
from hloserve.config import TracingConfig
from hloserve.errors import ConfigError
from hloserve.extras import require_extra

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from opentelemetry.sdk.trace.sampling import Sampler
    from opentelemetry.trace import Span, SpanKind
    from opentelemetry.util.types import AttributeValue

__all__ = ["RequestSpans", "Tracing", "check_tracing", "open_tracing", "settings", "triton_trace_settings"]

_SAMPLER_DEFAULT = "parentbased_always_on"


def settings(config: TracingConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The effective settings: each config field, else its `OTEL_*` variable, else the default."""
    env = os.environ if environ is None else environ
    endpoint = (
        config.endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        or "http://localhost:4317"
    )
    exporter = (config.exporter or env.get("OTEL_TRACES_EXPORTER", "") or "none").strip().lower()
    return {
        "exporter": "otlp" if exporter.split(",")[0] == "otlp" else "none",
        "endpoint": endpoint,
        "sampler": (config.sampler or env.get("OTEL_TRACES_SAMPLER", "") or _SAMPLER_DEFAULT).lower(),
        "sampler_arg": config.sampler_arg or env.get("OTEL_TRACES_SAMPLER_ARG", "") or "1.0",
        "service_name": config.service_name or env.get("OTEL_SERVICE_NAME", "") or "hloserve",
    }


def triton_trace_settings(chosen: Mapping[str, str]) -> dict[str, list[str]]:
    """`settings` as Triton's TraceSetting answers them (`trace_mode` opentelemetry; Triton's
    `trace_rate` is one request in N, here the sampler's ratio as N), plus the exporter's own."""
    on = chosen["exporter"] == "otlp"
    sampler = chosen["sampler"]
    ratio = 0.0 if sampler.endswith("always_off") else 1.0
    if sampler.endswith("traceidratio"):
        ratio = float(chosen["sampler_arg"])
    return {
        "trace_mode": ["opentelemetry"],
        "trace_level": ["TIMESTAMPS" if on else "OFF"],
        "trace_rate": [str(round(1 / ratio)) if ratio > 0 else "0"],
        "trace_count": ["-1"],
        "log_frequency": ["0"],
        "trace_file": [""],
        "url": [chosen["endpoint"] if on else ""],
        "sampler": [sampler],
        "sampler_arg": [chosen["sampler_arg"]],
        "service_name": [chosen["service_name"]],
    }


def check_tracing(config: TracingConfig, environ: Mapping[str, str] | None = None) -> None:
    """Raise a `ConfigError` when traces are asked for but the `otel` extra is not installed:
    what a worker checks before it loads a model."""
    env = os.environ if environ is None else environ
    if settings(config, env)["exporter"] == "otlp":
        where = "tracing.exporter" if config.exporter else "OTEL_TRACES_EXPORTER"
        require_extra("otel", where, "otlp (OpenTelemetry traces)")


def open_tracing(config: TracingConfig, environ: Mapping[str, str] | None = None) -> Tracing | None:
    """A `Tracing` when traces are exported, else None (and the SDK stays unimported).

    Raises:
        ConfigError: traces are asked for but the `otel` extra is not installed.
    """
    chosen = settings(config, environ)
    if chosen["exporter"] == "none":
        return None
    check_tracing(config, environ)
    return Tracing(chosen)


def _sampler(name: str, arg: str) -> Sampler:
    from opentelemetry.sdk.trace import sampling

    ratio = float(arg)
    root = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "traceidratio": sampling.TraceIdRatioBased(ratio),
    }
    if name.startswith("parentbased_"):
        return sampling.ParentBased(root[name.removeprefix("parentbased_")])
    return root[name]


class Tracing:
    """A tracer provider exporting to OTLP/gRPC, and the spans of requests."""

    def __init__(self, chosen: dict[str, str]) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ConfigError(
                "tracing.exporter", f"otlp needs the `otel` extra ({e}): pip install 'hloserve[otel]'"
            ) from None
        self.settings = chosen
        endpoint = chosen["endpoint"]
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": chosen["service_name"]}),
            sampler=_sampler(chosen["sampler"], chosen["sampler_arg"]),
        )
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("hloserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = SpanKind
        self._in_context = trace.set_span_in_context
        # monotonic → epoch nanoseconds, fixed once (the phases are marked with the monotonic clock)
        self._epoch_offset = time.time_ns() - time.monotonic_ns()

    def request(self, name: str, model: str, traceparent: str | None, started_ns: int) -> RequestSpans:
        """The spans of one request whose root `name` began at `started_ns` (monotonic)."""
        return RequestSpans(self, name, model, traceparent, started_ns, self._kinds.SERVER)

    def engine_request(self, model: str, traceparent: str) -> RequestSpans:
        """The engine's spans of a request a frontend sent over its link, under its `link` span;
        queue wait starts now."""
        started = time.monotonic_ns()
        spans = RequestSpans(self, "engine", model, traceparent, started, self._kinds.SERVER)
        if spans.engine is not None:
            spans.engine.enqueued_at = started / 1e9
        return spans

    def shutdown(self) -> None:
        """Export what is pending and stop."""
        self._provider.shutdown()


class RequestSpans:
    """One request's root span and its phases, each marked as it ends (`mark`)."""

    __slots__ = ("_context", "_last", "_recording", "_root", "_tracing", "engine")

    def __init__(
        self,
        tracing: Tracing,
        name: str,
        model: str,
        traceparent: str | None,
        started_ns: int,
        kind: SpanKind,
    ) -> None:
        self._tracing = tracing
        carrier = {"traceparent": traceparent} if traceparent else {}
        parent = tracing._propagator.extract(carrier)
        self._root = tracing._tracer.start_span(
            name,
            context=parent,
            kind=kind,
            start_time=started_ns + tracing._epoch_offset,
            attributes={"hloserve.model": model},
        )
        self._last = started_ns
        self._recording = self._root.is_recording()
        """Sampled: its phases become spans (an unsampled request makes no span but its root)."""
        self.engine: EngineTrace | None = EngineTrace() if self._recording else None
        """What the dispatcher fills for this request (None: the engine is in another process,
        or the request is not sampled)."""
        self._context = tracing._in_context(self._root)

    def mark(self, phase: str, **attributes: AttributeValue) -> None:
        """End the phase that began at the last mark now."""
        now = time.monotonic_ns()
        if self._recording:
            self.span(phase, self._last, now, None, **attributes)
        self._last = now

    def skip(self) -> None:
        """Begin the next phase now (the time since the last mark belongs to no phase)."""
        self._last = time.monotonic_ns()

    def span(
        self,
        phase: str,
        start_ns: int,
        end_ns: int,
        kind: SpanKind | None = None,
        **attributes: AttributeValue,
    ) -> Span:
        offset = self._tracing._epoch_offset
        span = self._tracing._tracer.start_span(
            phase,
            context=self._context,
            kind=kind if kind is not None else self._tracing._kinds.INTERNAL,
            start_time=start_ns + offset,
            attributes=attributes,
        )
        span.end(end_time=end_ns + offset)
        return span

    def link_span(self) -> tuple[Span, str]:
        """Open the `link` span (CLIENT) of a call to the engine process; returns it and the
        `traceparent` that names it, for the link's Run message."""
        span = self._tracing._tracer.start_span(
            "link", context=self._context, kind=self._tracing._kinds.CLIENT
        )
        carrier: dict[str, str] = {}
        self._tracing._propagator.inject(carrier, context=self._tracing._in_context(span))
        return span, carrier.get("traceparent", "")

    def record_engine(self) -> None:
        """Spans of the engine's phases (queue, weight_load, execute) from `engine`."""
        record = self.engine
        if record is None or not record.dequeued_at:
            return
        self.span("queue", _ns(record.enqueued_at), _ns(record.dequeued_at))
        for start, end, nbytes, overlapped in record.loads:
            self.span(
                "weight_load",
                _ns(start),
                _ns(end),
                **{"hloserve.weights.bytes": nbytes, "hloserve.weights.overlapped": overlapped},
            )
        for start, end, batch_size, batch_rows, rows in record.executions:
            self.span(
                "execute",
                _ns(start),
                _ns(end),
                **{
                    "hloserve.batch_size": batch_size,
                    "hloserve.batch_rows": batch_rows,
                    "hloserve.rows": rows,
                    "hloserve.padding_rows": batch_size - batch_rows,
                },
            )
        self._last = time.monotonic_ns()

    def end(self, status: str = "OK") -> None:
        """End the root span with the call's gRPC status name."""
        from opentelemetry.trace import Status, StatusCode

        self._root.set_attribute("rpc.grpc.status", status)
        if status != "OK":
            self._root.set_status(Status(StatusCode.ERROR, status))
        self._root.end(end_time=time.monotonic_ns() + self._tracing._epoch_offset)


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9)
