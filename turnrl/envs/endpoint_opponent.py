"""An agent behind an OpenAI-compatible endpoint in the other seat of a two-seat game
(``opponent: endpoint``, docs/selfplay.md), and how a trainer hands a player to each new env
(``attach_player``; the env's ``set_opponent``)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from turnrl.envs.base import Env


class EndpointError(RuntimeError):
    """An endpoint opponent's call failed: the game it was playing fails with this reason."""


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
        raise EndpointError("the endpoint's response has no choices[0].message.content: "
                            f"{str(payload)[:120]}") from None
    if not isinstance(content, str):
        raise EndpointError(f"the endpoint's reply content is {type(content).__name__}, "
                            "not text")
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

    def request(self, system_prompt: str | None, observation: str) -> urllib.request.Request:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": observation})
        body = json.dumps({"model": self.model, "messages": messages,
                           "max_tokens": self.max_tokens,
                           "temperature": self.temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.url, data=body, headers=headers, method="POST")

    def act(self, system_prompt: str | None, observation: str) -> str:
        try:
            with urllib.request.urlopen(self.request(system_prompt, observation),
                                        timeout=self.timeout_s) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise EndpointError(f"opponent {self.name} at {self.url} answered HTTP {err.code}: "
                                f"{err.read()[:200].decode(errors='replace')}") from None
        except TimeoutError:
            raise EndpointError(f"opponent {self.name} at {self.url} did not answer within "
                                f"{self.timeout_s:g}s (env.opponent_endpoint_timeout_s)"
                                ) from None
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, TimeoutError):
                raise EndpointError(f"opponent {self.name} at {self.url} did not answer within "
                                    f"{self.timeout_s:g}s (env.opponent_endpoint_timeout_s)"
                                    ) from None
            raise EndpointError(f"opponent {self.name} at {self.url} unreachable: {reason}"
                                ) from None
        except (OSError, ValueError) as err:
            raise EndpointError(f"opponent {self.name} at {self.url} failed: "
                                f"{type(err).__name__}: {err}") from None
        return reply_content(payload)

    def sample(self) -> EndpointOpponent:
        return self

    def attach(self, make: Callable[[], Env]) -> Callable[[], Env]:
        return attach_player(make, self.sample)


def attach_player(make: Callable[[], Env], choose: Callable[[], Any]) -> Callable[[], Env]:
    """``make`` with each new env's opponent ``choose()`` (handed over by ``set_opponent``)."""
    def make_with_opponent() -> Env:
        env = make()
        env.set_opponent(choose())
        return env
    return make_with_opponent
