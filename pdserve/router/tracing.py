"""Where a request's time goes: its hops to the first token, for ``/metrics`` and OpenTelemetry traces.

Each process stamps the moments it sees (wall clock, ``time.time()``): the router its HTTP arrival,
the send to the decode worker and the first token back; the workers the stamps of
``protocol.RequestTiming``, which reach the router with the request's first ``RequestDelta``. The
hops are the intervals between consecutive stamps, so they add up to the router's TTFT::

    disaggregated  router_queue | decode_admission | prefill_queue | prefill_compute | kv_transfer | first_token_back
    local prefill  router_queue | decode_queue | local_prefill_compute | first_token_back

    router_queue           HTTP arrival (router) -> GenerateRequest sent to the decode worker: checks,
                           tokenizing, routing (and waiting for a decode worker to register)
    decode_admission       -> the decode worker reserved the prompt's blocks and sent RemotePrefillRequest:
                           the message's way to the worker, its step loop, waiting for free blocks
    prefill_queue          -> the prefill worker's first step computing the prompt starts: the message's
                           way, connecting the KV pairs (first request of a pair), the prefill scheduler's queue
    prefill_compute        -> the step computing the prompt's last token returned, first token sampled
                           (every chunk's step and the steps of other prompts in between)
    kv_transfer            -> the decode worker has every KV piece and the done message, checked them and
                           told its ranks to install the KV (the layer-wise sends overlap prefill_compute;
                           this is what is left after it)
    first_token_back       -> the router's HTTP handler holds the first token (the decode worker's step
                           end, its delta's way back, the router's event loop)
    decode_queue           (local prefill) GenerateRequest sent -> the decode worker's first step computing
                           the prompt starts
    local_prefill_compute  (local prefill) -> that prompt's last token computed and the first token sampled

A request whose remote prefill failed and was recomputed locally is timed as a local prefill: its
``decode_queue`` holds the failed attempt. Migrated requests (their decode worker was lost) and
beam search are not broken down.

Clocks: stamps taken on different hosts are compared as they are, so a skew between two hosts'
clocks moves time between the two hops that meet at a hand-off between them (never more than the
skew). Each boundary is clamped between the one before it and the first token, so every hop is
>= 0 and the hops still sum to TTFT. On one host (``pdserve up``) all stamps read the same clock.
"""

from __future__ import annotations

import dataclasses
import logging

from pdserve.common.protocol import RequestTiming

logger = logging.getLogger(__name__)

DISAGGREGATED_PHASES = ("router_queue", "decode_admission", "prefill_queue", "prefill_compute", "kv_transfer",
                        "first_token_back")
LOCAL_PHASES = ("router_queue", "decode_queue", "local_prefill_compute", "first_token_back")
PHASES = tuple(dict.fromkeys(DISAGGREGATED_PHASES + LOCAL_PHASES))  # every hop name, each once
PREFILL_COMPUTE_PHASES = ("prefill_compute", "local_prefill_compute")

OTEL_MISSING = ("--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
                "pip install 'pdserve[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One hop of a request's way to its first token: ``start`` and ``end`` in wall-clock seconds."""

    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def request_phases(arrival: float, sent: float, timing: RequestTiming | None, first_token: float) -> list[Phase]:
    """A request's hops to its first token (see the module docstring), in order; [] if unknown.

    Args:
        arrival: HTTP arrival at the router; ``sent``: GenerateRequest sent to the decode worker;
            ``first_token``: the router's handler got the first token. All ``time.time()`` seconds.
        timing: the workers' stamps from the first delta (None: an older worker, or a migrated request).

    Returns [] unless every stamp of one path is there, so a hop histogram's count is the number of
    requests that took its path. Hops are >= 0 and sum to ``first_token - arrival`` (boundaries are
    clamped between their neighbours, for clock skew between hosts).
    """
    if timing is None:
        return []
    if timing.kv_installed is not None:
        names = DISAGGREGATED_PHASES
        stamps = (timing.remote_prefill_sent, timing.prefill_started, timing.prefill_done, timing.kv_installed)
    else:
        names = LOCAL_PHASES
        stamps = (timing.prefill_started, timing.prefill_done)
    if any(s is None for s in stamps):
        return []
    bounds = [arrival]
    for stamp in (sent, *stamps):
        bounds.append(min(max(stamp, bounds[-1]), first_token))
    bounds.append(max(first_token, bounds[-1]))
    return [Phase(name, start, end) for name, start, end in zip(names, bounds, bounds[1:])]


def check_otel_installed() -> None:
    """Raise ValueError (``OTEL_MISSING``) unless the OpenTelemetry SDK and OTLP/HTTP exporter import."""
    import importlib.util

    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            raise ValueError(OTEL_MISSING)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestTracer:
    """Exports one OpenTelemetry trace per finished request to an OTLP/HTTP (protobuf) endpoint.

    The trace is built when the request finishes, from the stamps already recorded: a parent span
    ``llm_request`` (HTTP arrival -> finish, with the ``gen_ai.*`` attributes vLLM sets, and one event
    per worker stamp, named as the ``RequestTiming`` field, at its unclamped time) and one child span
    per hop (``request_phases``), plus ``decode`` (first token -> finish). Spans are batched and sent
    by the SDK's ``BatchSpanProcessor`` on its own thread (its ``OTEL_BSP_*`` variables apply).

    Args:
        endpoint: the collector's traces URL, e.g. ``http://127.0.0.1:4318/v1/traces``.
        service_name: the ``service.name`` resource attribute.

    Raises:
        ValueError: the OpenTelemetry packages are not installed (``OTEL_MISSING``).
    """

    def __init__(self, endpoint: str, service_name: str = "pdserve-router"):
        check_otel_installed()
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("pdserve.router")

    def export(self, request_id: str, arrival: float, finish: float, phases: list[Phase],
               first_token: float | None = None, attributes: dict | None = None,
               events: dict[str, float] | None = None, error: str | None = None,
               traceparent: str | None = None) -> None:
        """Queue one request's trace for export (never blocks on the network).

        Args:
            request_id: the router's request_id (attribute ``gen_ai.request.id`` on every span).
            arrival, finish, first_token: ``time.time()`` seconds (first_token None: none came).
            phases: its hops (``request_phases``); one child span each.
            attributes: more attributes of the parent span (None values are left out).
            events: name -> ``time.time()`` seconds, events of the parent span (None values are left out).
            error: set: the parent span's status is ERROR with this description.
            traceparent: the client's W3C ``traceparent`` header: the request span joins that trace.
        """
        trace = self._trace
        context = self._propagator.extract({"traceparent": traceparent}) if traceparent else None
        attrs = {"gen_ai.request.id": request_id,
                 **{k: v for k, v in (attributes or {}).items() if v is not None}}
        if first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = first_token - arrival
        attrs["gen_ai.latency.e2e"] = finish - arrival
        parent = self._tracer.start_span("llm_request", context=context, kind=trace.SpanKind.SERVER,
                                         attributes=attrs, start_time=_ns(arrival))
        child_context = trace.set_span_in_context(parent)
        children = [*phases, *([Phase("decode", first_token, max(first_token, finish))]
                               if first_token is not None and phases else [])]
        for name, at in (events or {}).items():
            if at is not None:
                parent.add_event(name, timestamp=_ns(at))
        for phase in children:
            span = self._tracer.start_span(phase.name, context=child_context, start_time=_ns(phase.start),
                                           attributes={"gen_ai.request.id": request_id})
            span.end(end_time=_ns(phase.end))
        if error is not None:
            parent.set_status(trace.Status(trace.StatusCode.ERROR, error))
        parent.end(end_time=_ns(max(finish, arrival)))

    def shutdown(self) -> None:
        """Send what is queued (the SDK's export timeout bounds the wait) and stop the exporter thread."""
        try:
            self._provider.shutdown()
        except Exception:  # noqa: BLE001  a collector that is down must not break the router's exit
            logger.exception("flushing OpenTelemetry spans failed")
