"""An agent behind an OpenAI-compatible endpoint in the other seat of a two-seat game
(``opponent: endpoint``, docs/selfplay.md): one chat-completions call a move, on the standard
library, every failure one line naming the opponent, the URL and what to check."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

from turnrl.envs.base import Env
from turnrl.selfplay.opponents import attach_player
from turnrl.tools.mcp.http import one_line

MAX_REPLY_BYTES = 8 << 20
"""The most of a reply read (8 MiB): one move's chat completion is a few KB, and a server
sending without end must not fill the worker's memory."""


HTTP_FIXES = {401: "set TURNRL_OPPONENT_API_KEY to the endpoint's key",
              403: "set TURNRL_OPPONENT_API_KEY to the endpoint's key",
              404: "check env.opponent_endpoint and env.opponent_endpoint_model"}
"""What to check for an HTTP error status (others: the endpoint and its log)."""


OPENAI_FIX = "check that env.opponent_endpoint serves OpenAI-compatible chat completions"


class EndpointError(RuntimeError):
    """An endpoint opponent's call failed: the game it was playing fails with this reason."""


class ReplyError(Exception):
    """The endpoint's HTTP reply is too large or cut short (what it did, as a phrase)."""


def chat_completions_url(url: str) -> str:
    """The chat-completions route of ``url``: a base (``http://host:8000``, ``.../v1``) or the
    route itself."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return f"{url}/chat/completions" if url.endswith("/v1") else f"{url}/v1/chat/completions"


def reply_content(payload: Any) -> str:
    """The first choice's message text of a chat-completions response; ``EndpointError``
    naming what is missing otherwise."""
    try:
        content = payload["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError("sent a response with no choices[0].message.content "
                            f"({one_line(str(payload), 120)}): {OPENAI_FIX}"
                            ) from None
    if not isinstance(content, str):
        raise EndpointError(f"sent reply content of type {type(content).__name__}, not text: "
                            f"{OPENAI_FIX}")
    return content


class EndpointOpponent:
    """An agent behind an OpenAI-compatible endpoint in the other seat (``opponent:
    endpoint``): each move is one ``POST /v1/chat/completions`` (system prompt and the seat's
    observation) with the standard library, under ``timeout_s``. A failed, refused, hanging
    or malformed call raises ``EndpointError``: the env step fails, so that game ends
    ``error`` with the reason and the run goes on."""

    def __init__(self, url: str, model: str, *, timeout_s: float = 60.0, api_key: str = "",
                 max_tokens: int = 64, temperature: float = 1.0) -> None:
        self.url, self.model = chat_completions_url(url), model
        self.timeout_s, self.api_key = timeout_s, api_key
        self.max_tokens, self.temperature = max_tokens, temperature
        self.members = [self]

    @classmethod
    def from_config(cls, cfg: Any) -> EndpointOpponent:
        env = cfg.env
        return cls(env.opponent_endpoint, env.opponent_endpoint_model,
                   timeout_s=env.opponent_endpoint_timeout_s,
                   api_key=os.environ.get("TURNRL_OPPONENT_API_KEY", ""),
                   max_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)

    @property
    def name(self) -> str:
        """What episodes record as their ``opponent``."""
        return f"endpoint:{self.model}"

    def body(self, system_prompt: str | None, observation: str) -> bytes:
        """The chat-completions request of one move, as JSON."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": observation})
        return json.dumps({"model": self.model, "messages": messages,
                           "max_tokens": self.max_tokens,
                           "temperature": self.temperature}).encode()

    def headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def act(self, system_prompt: str | None, observation: str) -> str:
        """The endpoint's move; ``EndpointError`` (one line: the opponent, the URL, what went
        wrong and what to check) on any failure of the call, whatever layer it comes from."""
        where = f"opponent {self.name} at {self.url}"
        try:
            status, reason, raw, location = post(self.url, self.body(system_prompt, observation),
                                                 self.headers(), self.timeout_s)
        except TimeoutError:
            raise EndpointError(f"{where} did not answer within {self.timeout_s:g}s: check the "
                                "endpoint, or raise env.opponent_endpoint_timeout_s") from None
        except ReplyError as err:
            raise EndpointError(f"{where} {err}") from None
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise EndpointError(f"{where} unreachable or cut off ({_reason(err)}): check "
                                "env.opponent_endpoint and that the endpoint is running"
                                ) from None
        if 300 <= status < 400:
            raise EndpointError(f"{where} answered HTTP {status} {reason}, a redirect to "
                                f"'{location}': give env.opponent_endpoint as the final URL")
        if status != 200:
            raise EndpointError(f"{where} answered HTTP {status} {reason}{_body_text(raw)}: "
                                f"{HTTP_FIXES.get(status, 'check the endpoint and its log')}")
        try:
            return reply_content(json.loads(raw))
        except ValueError:  # not JSON (or not UTF-8): a proxy's page, a wrong route
            raise EndpointError(f"{where} answered HTTP 200 with a body that is not JSON"
                                f"{_body_text(raw)}: {OPENAI_FIX}") from None
        except EndpointError as err:
            raise EndpointError(f"{where} {err}") from None

    def sample(self) -> EndpointOpponent:
        return self

    def attach(self, make: Callable[[], Env]) -> Callable[[], Env]:
        return attach_player(make, self.sample)


def post(url: str, body: bytes, headers: dict, timeout_s: float
         ) -> tuple[int, str, bytes, str]:
    """(status, reason, body, Location) of one POST to ``url``, all of it within
    ``timeout_s``: a timer shuts the socket down when time is up, since a socket timeout bounds
    each read but not the call (a server trickling bytes would never time out). Redirects are
    not followed (a POST redirected would lose its body). Raises ``TimeoutError``,
    ``ReplyError``, or what the network and ``http.client`` raise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"'{url}' is not an http:// or https:// URL")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=timeout_s)
    expired = threading.Event()
    timer = threading.Timer(timeout_s, _expire, (connection, expired))
    timer.daemon = True
    timer.start()
    try:
        connection.connect()
        if expired.is_set():
            raise TimeoutError
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        raw = read_reply(response)
        if expired.is_set():  # the shutdown may read as the end of a short answer
            raise TimeoutError
        return response.status, response.reason, raw, response.getheader("Location") or ""
    except (OSError, http.client.HTTPException, ReplyError):
        if expired.is_set():
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()
        connection.close()


def read_reply(response: http.client.HTTPResponse) -> bytes:
    """The body of ``response``: ``ReplyError`` when it is over ``MAX_REPLY_BYTES`` or ends
    before its ``Content-Length`` (``read(n)`` returns a short body without saying so)."""
    if (response.length or 0) > MAX_REPLY_BYTES:
        raise ReplyError(f"answered with a body of {response.length} bytes, over the "
                         f"{MAX_REPLY_BYTES >> 20} MiB a reply may take: {OPENAI_FIX}")
    raw = response.read(MAX_REPLY_BYTES + 1)
    if len(raw) > MAX_REPLY_BYTES:
        raise ReplyError(f"sent a reply over {MAX_REPLY_BYTES >> 20} MiB: {OPENAI_FIX}")
    if response.length:
        announced = len(raw) + response.length
        raise ReplyError(f"cut its reply short ({len(raw)} bytes of the {announced} its "
                         "Content-Length announced): check the "
                         "endpoint and any proxy before it")
    return raw


def _expire(connection: http.client.HTTPConnection, expired: threading.Event) -> None:
    """The call's time is up: unblock whatever read or write it is in."""
    expired.set()
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _reason(err: BaseException) -> str:
    """A network error in a few words: the OS's, else the exception's (with its name)."""
    if isinstance(err, socket.gaierror):
        return f"host not found: {err.strerror or err}"
    if type(err) is http.client.BadStatusLine:  # its text is the server's raw bytes
        return f"a status line that is not HTTP: {one_line(str(err), 60)}"
    words = getattr(err, "strerror", None) or one_line(str(err), 200)
    return f"{type(err).__name__}: {words}" if words else type(err).__name__


def _body_text(raw: bytes) -> str:
    text = one_line(raw.decode("utf-8", errors="replace"), 200)
    return f": {text}" if text else ""
