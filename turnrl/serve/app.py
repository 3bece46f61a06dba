"""The HTTP face of ``Server``: FastAPI routes in OpenAI's shapes, auth, and how to run it.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (JSON or server-sent events),
``POST /v1/responses`` and ``GET /v1/responses/{id}`` (the Responses API, serve/responses.py),
Anthropic's ``POST /v1/messages`` (serve/messages.py), and TurnRL's own
``POST /v1/turnrl/episodes/{id}/reward``, ``GET /v1/turnrl/episodes`` and
``GET /v1/turnrl/episodes/{id}`` (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import socket
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request  # the serve extra: pip install 'turnrl[serve]'
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from turnrl.serve import messages
from turnrl.serve.monitor import add_monitor_routes
from turnrl.serve.protocol import (
    EPISODE_HEADER,
    ApiError,
    bad,
    choice_message,
    chunk_body,
    completion_body,
    logprobs_block,
    new_id,
    parse_chat_request,
    usage,
)
from turnrl.serve.responses import ResponsesApi
from turnrl.serve.server import Choice, Server


def make_app(server: Server) -> FastAPI:
    """The FastAPI app serving ``server``: its batcher runs for the app's lifetime."""
    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(server.batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="TurnRL", lifespan=lifespan)
    _add_guards(app, server.cfg.api_key)
    _add_model_routes(app, server)
    _add_responses_routes(app, server)
    _add_messages_routes(app, server)
    _add_episode_routes(app, server)
    add_monitor_routes(app, server)  # /health and /metrics, outside /v1: no key (monitor.py)
    return app


def _add_guards(app: FastAPI, key: str) -> None:
    """The API key check (``Authorization: Bearer KEY``, or ``x-api-key: KEY`` as Anthropic's
    clients send it) and the handlers that turn every error into the JSON shape of the API
    the path belongs to: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if key and request.url.path.startswith("/v1"):
            sent = request.headers.get("authorization", "")
            if not (hmac.compare_digest(sent.encode(), f"Bearer {key}".encode())
                    or hmac.compare_digest(request.headers.get("x-api-key", "").encode(),
                                           key.encode())):
                return _error(request, ApiError(401, "missing or wrong API key: send "
                                                "'Authorization: Bearer KEY' or 'x-api-key: "
                                                "KEY' (the client's api_key)",
                                                code="invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return _error(request, err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return _error(request, ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        return _error(request, ApiError(500, f"{type(err).__name__}: {err}",
                                        kind="server_error"))


def _error(request: Request, err: ApiError) -> JSONResponse:
    if messages.PATH in request.url.path:
        return JSONResponse(messages.error_body(err.status, err.message), err.status)
    return JSONResponse(err.body(), err.status)


def _add_model_routes(app: FastAPI, server: Server) -> None:
    """The OpenAI-compatible routes: the model list and chat completions."""
    def model_card() -> dict:
        return {"id": server.name, "object": "model", "created": 0, "owned_by": "turnrl",
                "policy_version": server.engine.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != server.name:
            raise ApiError(404, f"the model '{name}' does not exist", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request, server.cfg)
        chat = parse_chat_request(body, request.headers.get(EPISODE_HEADER), server.cfg.max_n)
        if chat.stream:
            prepared = server.prompt(chat)  # bad input fails here, as JSON, before the stream
            return StreamingResponse(_stream(server, chat, prepared),
                                     media_type="text/event-stream")
        choices, prompt_tokens = await server.complete(chat)
        return completion_body(new_id("chatcmpl"), server.name,
                               [_choice_json(server, i, c, chat.logprobs)
                                for i, c in enumerate(choices)],
                               prompt_tokens, sum(len(c.token_ids) for c in choices))


def _add_responses_routes(app: FastAPI, server: Server) -> None:
    """The OpenAI Responses API: create a response (JSON or server-sent events), get one."""
    api = ResponsesApi(server)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await read_json(request, server.cfg)
        reply = await api.create(body, request.headers.get(EPISODE_HEADER))
        if isinstance(reply, dict):
            return reply
        return StreamingResponse(reply, media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return api.retrieve(response_id)


def _add_messages_routes(app: FastAPI, server: Server) -> None:
    """Anthropic's Messages API: served and recorded as chat completions are; also under
    ``/v1/turnrl/episodes/{id}``, a base URL that names the episode (for a harness that
    takes a base URL and no extra header)."""
    @app.post(messages.PATH)
    async def create_message(request: Request):
        return await reply(request, request.headers.get(EPISODE_HEADER))

    @app.post("/v1/turnrl/episodes/{episode_id}" + messages.PATH)
    async def create_episode_message(episode_id: str, request: Request):
        return await reply(request, episode_id)

    async def reply(request: Request, episode: str | None):
        body = await read_json(request, server.cfg)
        chat = messages.parse_messages_request(body, episode)
        prepared = server.prompt(chat)  # bad input fails here, as JSON, before any stream
        if chat.stream:
            return StreamingResponse(messages.message_events(server, chat, prepared),
                                     media_type="text/event-stream")
        try:
            (choice,), prompt_tokens = await server.complete(chat, prepared=prepared)
        except Exception as err:  # noqa: BLE001 - as an ApiError: Starlette re-raises others
            # after answering and the connection may be reset before the client reads it
            raise ApiError(500, f"{type(err).__name__}: {err}", kind="server_error") from None
        return messages.message_body(server, chat, choice, prompt_tokens)

    @app.post(messages.PATH + "/count_tokens")
    @app.post("/v1/turnrl/episodes/{episode_id}" + messages.PATH + "/count_tokens")
    async def count_tokens(request: Request):
        body = await read_json(request, server.cfg)
        if isinstance(body, dict):  # no reply is asked for: any length will do
            body.setdefault("max_tokens", 1)
        return messages.count_tokens(server, messages.parse_messages_request(body, None))


def _add_episode_routes(app: FastAPI, server: Server) -> None:
    """TurnRL's own routes: an episode's reward, the recorded episodes."""
    @app.post("/v1/turnrl/episodes/{episode_id}/reward")
    async def reward(episode_id: str, request: Request):
        body = await read_json(request, server.cfg)
        try:
            value = float(body["reward"])
        except (KeyError, TypeError, ValueError, OverflowError):
            value = math.nan
        if not math.isfinite(value):
            raise bad("send {\"reward\": NUMBER}, a finite number", "reward")
        try:
            server.recorder.set_reward(episode_id, value)
        except KeyError as err:
            raise ApiError(404, err.args[0], code="episode_not_found") from None
        except ValueError as err:  # not finite (Episode.reward_problem)
            raise bad(str(err), "reward") from None
        recorded = server.recorder.episodes[episode_id]
        return {"episode_id": episode_id, "reward": value, "segments": len(recorded.segments)}

    @app.get("/v1/turnrl/episodes")
    async def episodes():
        return {"data": [{"episode_id": e, "calls": r.calls, "segments": len(r.segments),
                          "reward": r.reward} for e, r in server.recorder.episodes.items()],
                "unrewarded": server.recorder.unrewarded()}

    @app.get("/v1/turnrl/episodes/{episode_id}")
    async def episode(episode_id: str):
        if episode_id not in server.recorder.episodes:
            raise ApiError(404, f"no episode '{episode_id}' was recorded",
                           code="episode_not_found")
        return server.recorder.episodes[episode_id].to_dict()


async def read_json(request: Request, cfg) -> object:
    """The request's body parsed as JSON, read within ``cfg.body_timeout_s`` and at most
    ``cfg.max_body_mb`` MiB; ``ApiError`` otherwise (413, 408, or 400: not JSON, not UTF-8,
    nested past the parser's depth, or the client left before the body ended)."""
    limit = int(cfg.max_body_mb * (1 << 20))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(cfg)
    try:
        raw = await asyncio.wait_for(_body(request, limit, cfg), cfg.body_timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                       "(serve.body_timeout_s): send it whole", code="request_timeout") from None
    except ClientDisconnect:
        raise bad("the client closed the connection before the request body ended") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON ({type(err).__name__}: "
                  f"{str(err)[:100]}): send a UTF-8 JSON object") from None


async def _body(request: Request, limit: int, cfg) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(cfg)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(cfg) -> ApiError:
    return ApiError(413, f"the request body is over {cfg.max_body_mb:g} MiB "
                    "(serve.max_body_mb): send less, or raise serve.max_body_mb",
                    code="request_too_large")


def _choice_json(server: Server, index: int, choice: Choice, logprobs: bool) -> dict:
    out = {"index": index, "message": choice_message(choice.content, choice.tool_calls),
           "finish_reason": choice.finish_reason, "logprobs": None}
    if logprobs:
        ids = choice.token_ids[:choice.visible]
        out["logprobs"] = logprobs_block(server.token_texts(ids), choice.logprobs[:len(ids)],
                                         choice.top_logprobs)
    return out


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


_replies: set[asyncio.Task] = set()
"""Replies whose client went away: still generated and recorded, held here until done."""


async def _stream(server: Server, chat, prepared: tuple):
    """Server-sent events: the role at once, then the content as it is generated (what of it
    ``ReplyStream`` can already send; the engine's batch goes on for every request in it),
    then the rest, the tool calls, the finish reason, the usage if asked, and [DONE]."""
    request_id, model = new_id("chatcmpl"), server.name

    def chunk(index: int, delta: dict, finish: str | None = None, ids=(), logprobs=()) -> str:
        block = logprobs_block(server.token_texts(list(ids)), list(logprobs)) \
            if chat.logprobs and ids else None
        return _sse(chunk_body(request_id, model, index, delta, finish, logprobs=block))

    for i in range(chat.n):
        yield chunk(i, {"role": "assistant", "content": ""})
    tokens: asyncio.Queue = asyncio.Queue()
    reply = asyncio.create_task(server.complete(chat, tokens, prepared))
    _replies.add(reply)
    reply.add_done_callback(_replies.discard)
    streams = [server.reply_stream(chat, prepared[3]) for _ in range(chat.n)]
    done = False
    while not done:
        events = [await tokens.get()]
        while not tokens.empty():  # everything sampled meanwhile: one chunk per choice
            events.append(tokens.get_nowait())
        done = events[-1] is None
        for index, token, logprob in filter(None, events):
            streams[index].add(token, logprob)
        for i, stream in enumerate(streams):
            text, ids, logprobs = stream.take()
            if text:
                yield chunk(i, {"content": text}, None, ids, logprobs)
    try:
        choices, prompt_tokens = await reply
    except Exception as err:  # noqa: BLE001 - the stream has started: the error goes in it
        yield _sse(ApiError(500, f"{type(err).__name__}: {err}", kind="server_error").body())
        return
    for i, (choice, stream) in enumerate(zip(choices, streams, strict=True)):
        rest = stream.rest(choice.content or "")
        sent = min(stream.sent_tokens, choice.visible)
        ids = choice.token_ids[sent:choice.visible]
        if rest or (chat.logprobs and ids):
            yield chunk(i, {"content": rest}, None, ids, choice.logprobs[sent:choice.visible])
        if choice.tool_calls:
            calls = [{"index": k, **call} for k, call in enumerate(choice.tool_calls)]
            yield chunk(i, {"tool_calls": calls})
        yield chunk(i, {}, choice.finish_reason)
    if chat.include_usage:
        yield _sse({"id": request_id, "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model, "choices": [],
                    "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))})
    yield _sse("[DONE]")


class RunningServer:
    """A server on a thread of this process (tests, ``train_agent``, benchmarks)."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = server
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        config = uvicorn.Config(make_app(server), log_level="warning", lifespan="on")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def serve_forever(server: Server) -> None:
    """``turnrl serve``: listen on serve.host:serve.port until interrupted."""
    import uvicorn

    cfg = server.cfg
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))  # port 0: the port printed is the one taken
    print(f"serving '{server.name}' at http://{cfg.host}:{sock.getsockname()[1]}/v1"
          f"{' (API key required)' if cfg.api_key else ''}", flush=True)
    config = uvicorn.Config(make_app(server), log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
