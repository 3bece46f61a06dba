"""Config section of ``turnrl serve``: where the OpenAI-compatible endpoint listens and how it
batches and records (docs/serving.md).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from turnrl.config.types import ConfigError, Section


@dataclass(frozen=True)
class ServeConfig(Section):
    host: str = "127.0.0.1"
    """address to bind; anything but a loopback address needs serve.api_key"""
    port: int = 8000
    """TCP port (0 = any free port, printed at start-up)"""
    api_key: str = ""
    """clients must send 'Authorization: Bearer KEY' when set; required off loopback"""
    model_name: str = ""
    """the model id clients ask for ('' = model.name)"""
    checkpoint: str = ""
    """serve these weights: a RUN_DIR/checkpoints/step-NNNNNN directory ('' = model.name's)"""
    max_tokens: int = 256
    """completion tokens when a request sets no max_tokens (capped by the context left)"""
    max_n: int = 16
    """largest n (choices per request) accepted"""
    max_batch_rows: int = 64
    """most rows (choices) generated in one engine call; later requests wait for the next"""
    batch_window_s: float = 0.005
    """an idle engine gathers a burst of requests in steps of this long while more keep
    arriving (at most a quarter of its last call's time) before it generates"""
    record_dir: str = ""
    """write every recorded episode here as JSONL when it gets its reward ('' = keep in memory)"""
    max_body_mb: float = 16.0
    """largest request body accepted, in MiB (larger: HTTP 413)"""
    body_timeout_s: float = 30.0
    """a request body must arrive within this long (a stalled client: HTTP 408)"""
    groups_in_flight: int = 0
    """train_agent in run.mode async: task groups played at once (0 = 2 x
    rollout.groups_per_step)"""

    def _check(self) -> None:
        self._require("port", 0 <= self.port <= 65535, "in [0, 65535]")
        self._at_least(1, "max_tokens", "max_n", "max_batch_rows")
        self._at_least(0, "batch_window_s", "groups_in_flight")
        self._require("max_body_mb", self.max_body_mb > 0, "> 0")
        self._require("body_timeout_s", self.body_timeout_s > 0, "> 0")
        check_bind(self.host, self.api_key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, api_key: str) -> None:
    """Refuse to expose the policy off this machine without a key (one line, the fix)."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"serve.host {host} is not a loopback address: anyone who can reach "
                          "it could use and record into the served policy; pass "
                          "--serve.api_key KEY (clients send it as their API key) or bind "
                          "127.0.0.1")
