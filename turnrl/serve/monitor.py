"""``GET /health`` and ``GET /metrics`` (Prometheus text) for the served policy.

Both sit outside ``/v1``, so the API key never guards them (a load balancer's probe and a
Prometheus scraper carry no key); they tell how busy the server is and nothing of what it
was asked. ``/metrics`` is the Prometheus text exposition format, version 0.0.4: counters
since the server started (requests by route and status, completions, prompt and completion
tokens, engine calls, episodes recorded) and gauges read at scrape time (choices waiting
for the engine, recorded episodes held and unrewarded, the policy version served).
docs/serving.md lists them.
"""

from __future__ import annotations

import time
from collections import Counter

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.routing import Match

from turnrl.prometheus import CONTENT_TYPE, Family, exposition
from turnrl.serve.server import Server


class HttpCounts:
    """Requests by (route, method, status) and their seconds to the response's start."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.seconds: Counter = Counter()
        self.started = time.time()

    def add(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests[route, method, str(status)] += 1
        self.seconds[route] += seconds


def families(server: Server, http: HttpCounts) -> list[Family]:
    """What ``/metrics`` reports, read now."""
    counts, batcher, recorder = server.counts, server.batcher, server.recorder
    per_route = Counter()
    for (route, _, _), n in http.requests.items():
        per_route[route] += n
    plain = [
        ("turnrl_completions_total", "counter", "replies served (chat completions and "
         "responses)", counts["completions"]),
        ("turnrl_choices_total", "counter", "choices served (n per completion)",
         counts["choices"]),
        ("turnrl_prompt_tokens_total", "counter", "prompt tokens of the completions served",
         counts["prompt_tokens"]),
        ("turnrl_completion_tokens_total", "counter", "tokens generated for the choices "
         "served", counts["completion_tokens"]),
        ("turnrl_engine_calls_total", "counter", "batched engine generate calls", batcher.calls),
        ("turnrl_engine_rows_total", "counter", "rows across the engine calls", batcher.rows),
        ("turnrl_engine_joins_total", "counter", "engine calls stopped early so that waiting "
         "requests join the batch", batcher.joins),
        ("turnrl_engine_last_call_seconds", "gauge", "wall seconds of the latest engine call",
         batcher.last_call_s),
        ("turnrl_queue_depth", "gauge", "choices waiting for the engine", batcher.waiting),
        ("turnrl_episodes_recorded_total", "counter", "episode ids recorded",
         recorder.started),
        ("turnrl_recorded_calls_total", "counter", "calls recorded into episodes",
         recorder.recorded_calls),
        ("turnrl_episodes_held", "gauge", "recorded episodes not yet taken by training",
         len(recorder.episodes)),
        ("turnrl_episodes_unrewarded", "gauge", "recorded episodes still waiting for a "
         "reward", len(recorder.unrewarded())),
        ("turnrl_policy_version", "gauge", "policy version of the weights served",
         server.engine.version),
        ("turnrl_uptime_seconds", "gauge", "seconds since the server started",
         time.time() - http.started),
    ]
    out: list[Family] = [(name, kind, text, [({}, float(value))])
                         for name, kind, text, value in plain]
    out.append(("turnrl_http_requests_total", "counter", "HTTP requests by route, method "
                "and status", [({"route": r, "method": m, "status": s}, float(n))
                               for (r, m, s), n in sorted(http.requests.items())]))
    out.append(("turnrl_http_request_duration_seconds", "summary", "seconds from a request "
                "to its response's start (a stream's first byte)",
                [({"__name__": "_sum", "route": r}, http.seconds[r]) for r in sorted(per_route)]
                + [({"__name__": "_count", "route": r}, float(n))
                   for r, n in sorted(per_route.items())]))
    return out


def route_of(app: FastAPI, request: Request) -> str:
    """The route template a request matched (``/v1/turnrl/episodes/{episode_id}``: one
    label for every id), also for one the API key turned away before routing; "unmatched"
    for a path no route serves (404)."""
    route = request.scope.get("route")
    if route is None:
        route = next((r for r in app.routes if r.matches(request.scope)[0] == Match.FULL),
                     None)
    return getattr(route, "path", "unmatched")


def add_monitor_routes(app: FastAPI, server: Server) -> None:
    """``/health``, ``/metrics`` and the middleware that counts every request (those the
    API key turns away included)."""
    http = HttpCounts()

    @app.middleware("http")
    async def count(request: Request, call_next):
        start = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception:  # answered 500 by the app's outermost handler
            http.add(route_of(app, request), request.method, 500, time.perf_counter() - start)
            raise
        http.add(route_of(app, request), request.method, response.status_code,
                 time.perf_counter() - start)
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name, "policy_version": server.engine.version,
                "queue_depth": server.batcher.waiting,
                "uptime_s": round(time.time() - http.started, 3)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(exposition(families(server, http)), media_type=CONTENT_TYPE)
