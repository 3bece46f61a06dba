"""Envs that leave things behind when the run ends (``test_leftovers.py`` runs ``turnrl``
and scripts with them): a non-daemon thread that loops, one blocked on an Event nobody sets,
a child process that sleeps, a file left open, all three at once. Each otherwise plays the
say-digit task."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from turnrl.envs import StepResult, register_env

LEFT_OPEN: list = []


class _Leaky:
    """One say-digit turn; ``leave()`` runs once per process, at the first reset."""

    left = False

    async def reset(self, seed: int) -> str:
        if not type(self).left:
            type(self).left = True
            self.leave()
        return "Say a digit."

    async def step(self, action: str) -> StepResult:
        ok = action[:1].isdigit()
        return StepResult("", float(ok), True, {"success": ok})

    def leave(self) -> None:
        raise NotImplementedError


def _poll_forever() -> None:
    while True:
        time.sleep(0.2)


@register_env("leaky-thread")
class LoopingThread(_Leaky):
    """A non-daemon thread that polls forever."""

    def leave(self) -> None:
        threading.Thread(target=_poll_forever, name="leaky-poller", daemon=False).start()


@register_env("leaky-event")
class EventThread(_Leaky):
    """A non-daemon thread blocked on an Event nobody sets."""

    def leave(self) -> None:
        threading.Thread(target=threading.Event().wait, name="leaky-waiter",
                         daemon=False).start()


@register_env("leaky-child")
class SleepingChild(_Leaky):
    """A child process that sleeps for ten minutes, never waited for."""

    def leave(self) -> None:
        LEFT_OPEN.append(subprocess.Popen([sys.executable, "-c",
                                           "import time; time.sleep(600)"]))


@register_env("leaky-file")
class OpenFile(_Leaky):
    """A file opened and never closed."""

    def leave(self) -> None:
        import tempfile

        LEFT_OPEN.append(tempfile.NamedTemporaryFile("w", prefix="leaky-", suffix=".log"))


@register_env("leaky-all")
class LeavesAll(_Leaky):
    """A polling non-daemon thread, a sleeping child process and an open file, at once."""

    def leave(self) -> None:
        for leaky in (LoopingThread, SleepingChild, OpenFile):
            leaky.leave(self)


@register_env("tidy")
class Tidy(_Leaky):
    """Leaves nothing behind (the control)."""

    def leave(self) -> None:
        pass


def _spin_torch(past_exit_s: float | None) -> None:
    """Native work (torch products), forever (``past_exit_s`` None) or until ``past_exit_s``
    after Python's exit has begun (the main thread has ended): what a model user's overrun
    generation is doing while the run ends."""
    import torch

    a, main = torch.randn(256, 256), threading.main_thread()
    while past_exit_s is None or main.is_alive():
        a = torch.tanh(a @ a)
    end = time.monotonic() + past_exit_s
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


@register_env("busy-torch")
class BusyTorch(_Leaky):
    """Its first step runs torch products forever on the env's own (daemon) thread: the call
    times out and is abandoned, still running when the process exits. Python 3.11-3.13 then
    end that thread inside torch's C++ frames, which aborts the process (SIGABRT)."""

    spun = False
    past_exit_s: float | None = None

    async def step(self, action: str) -> StepResult:
        if not BusyTorch.spun:
            BusyTorch.spun = True
            _spin_torch(self.past_exit_s)
        return await super().step(action)

    def leave(self) -> None:
        pass


@register_env("busy-torch-past-exit")
class BusyTorchPastExit(BusyTorch):
    """As ``busy-torch``, until 2 s into Python's exit: an overrun call that then ends."""

    past_exit_s = 2.0
