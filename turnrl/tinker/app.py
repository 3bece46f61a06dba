"""The HTTP face of the Tinker service: the ``/api/v1`` routes the ``tinker`` client calls
(read from its source, tinker 0.38), and ``serve_forever`` for ``turnrl tinker``.

Work goes to the service's worker and answers a request id; ``retrieve_future`` answers the
result (protobuf for forward_backward and sample, JSON otherwise), ``try_again`` while it
runs, or ``{"error", "category": "user"}``, which the client raises as
``tinker.RequestFailedError``. Calls that need no model (sessions, heartbeats, telemetry,
client config) answer at once.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from turnrl.tinker.service import RequestError, Service
from turnrl.tinker.wire import read_forward_backward

PROTO = "application/x-protobuf"
POLL_S = 20.0  # a retrieve_future waits this long for its result before answering try_again


def make_app(service: Service, api_key: str = "") -> FastAPI:
    app = FastAPI(title="TurnRL Tinker service")

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        sent = request.headers.get("x-api-key") or request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(sent.removeprefix("Bearer ").encode(),
                                               api_key.encode()):
            return JSONResponse({"error": "missing or wrong API key: set TINKER_API_KEY to "
                                 "the service's serve.api_key"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, err: RequestError):
        return JSONResponse({"error": str(err), "category": "user"}, status_code=400)

    _add_session_routes(app, service)
    _add_work_routes(app, service)
    return app


def _add_session_routes(app: FastAPI, service: Service) -> None:
    @app.api_route("/api/v1/healthz", methods=["GET", "POST"])
    async def health():
        return {"status": "ok"}

    @app.api_route("/api/v1/client/config", methods=["GET", "POST"])
    async def client_config():
        # httpx transport and per-request polling: the plain paths this service serves
        return {"use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                "proto_compress_fwdbwd": False}

    @app.api_route("/api/v1/client/dynamic_config", methods=["GET", "POST"])
    async def dynamic_config():
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session():
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        service.sessions.add(session_id)
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat():
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        service.sessions.discard(session_id)
        return {}

    @app.api_route("/api/v1/get_server_capabilities", methods=["GET", "POST"])
    async def capabilities():
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                     for name in service.bases]}

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await request.json()
        target = body.get("model_path") or body.get("base_model")
        session = await asyncio.to_thread(service.new_sampling_session, target)
        return {"type": "create_sampling_session", "sampling_session_id": session}

    @app.get("/api/v1/samplers/{session}")
    async def sampler(session: str):
        return service.sampler_info(session)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return service.get_info((await request.json())["model_id"])


def _add_work_routes(app: FastAPI, service: Service) -> None:
    json_work = {"create_model": service.create_model, "optim_step": service.optim_step,
                 "save_weights_for_sampler": service.save_for_sampler,
                 "save_weights": service.save_state, "load_weights": service.load_state}
    for name, fn in json_work.items():
        app.post(f"/api/v1/{name}")(_queued(service, fn))

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = await request.json()
        queued = service.submit_sample(body)
        # the client names each sequence it will get back (for provenance spans)
        queued["sample_sequence_ids"] = [f"{queued['request_id']}-{i}"
                                         for i in range(int(body.get("num_samples", 1)))]
        return queued

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        return service.submit(service.forward_backward, read_forward_backward(body))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        request_id = (await request.json())["request_id"]
        future = service.future(request_id)
        try:  # shielded: a poll that times out must not cancel the work
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), POLL_S)
        except TimeoutError:
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        except RequestError as err:
            return {"error": str(err), "category": "user"}
        except Exception as err:  # a bug here: say so, and keep serving
            return {"error": f"{type(err).__name__}: {err}", "category": "server"}
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return result


def _queued(service: Service, fn):
    """A route that queues ``fn(json body)`` (a closure: FastAPI would read a defaulted
    argument as a query parameter)."""
    async def route(request: Request):
        return service.submit(fn, await request.json())
    return route


def serve_forever(service: Service, host: str, port: int, api_key: str = "") -> None:
    """``turnrl tinker``: listen until interrupted; the URL printed is the client's base_url."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    print(f"tinker service for '{service.default_model}' at http://{host}:"
          f"{sock.getsockname()[1]} (base_url; out_dir {Path(service.out_dir)})", flush=True)
    config = uvicorn.Config(make_app(service, api_key), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
