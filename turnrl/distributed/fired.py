"""The learner's calls to rollout workers whose answers it never needs (weights, assignments,
withdrawals, resizes, the opponent pool): ``FiredCalls`` keeps them until they finish, so a
failure is still seen, at the next poll, and named in one line."""

from __future__ import annotations

import logging

log = logging.getLogger("turnrl.worker")


class FiredCalls:
    """(ref, worker, method) of each call fired and not yet checked."""

    def __init__(self, ray) -> None:
        self.ray = ray
        self.calls: list[tuple[object, int | None, str]] = []

    def fire(self, ref, worker: int | None = None, method: str = "") -> None:
        """A call whose answer we never need; kept so that a failure is seen at the next
        ``check`` and named with ``worker`` and ``method``."""
        self.calls.append((ref, worker, method))

    def check(self) -> None:
        """The fired calls that have finished (never waits): an actor that died is left to
        the poll path; a method that raised is one line naming the worker, the method and
        the cause. A failed ``set_pool`` raises (that worker's games would all fail without
        their opponents); any other is logged, as the books repair it: weights missing at
        the next report are sent again, an assignment that never arrived is re-issued, a
        withdrawal that failed leaves a group played twice (its first delivery counts), a
        resize that failed leaves the worker's pool at its old size. Any other Ray error (a
        lost object, a cancelled call) is logged the same way."""
        if not self.calls:
            return
        refs = [ref for ref, _, _ in self.calls]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        if not done:
            return
        finished = set(done)
        calls = [call for call in self.calls if call[0] in finished]
        self.calls = [call for call in self.calls if call[0] not in finished]
        for ref, worker, method in calls:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass  # the poll path notices dead workers
            except self.ray.exceptions.RayTaskError as err:
                line = fired_failure(worker, method, err)
                if method == "set_pool":
                    raise RuntimeError(line) from None
                log.warning("%s", line)
            except self.ray.exceptions.RayError as err:  # lost object, cancelled call...
                log.warning("%s", fired_failure(worker, method, err))


def fired_failure(worker: int | None, method: str, err: Exception) -> str:
    """One line for a fired call that raised: the worker, the method, the cause. Calls fired
    for another module (the weight group's ``receive_weights``) carry no worker; the error
    then names the method."""
    method = method or getattr(err, "function_name", "") or "a call"
    who = f"rollout worker {worker}" if worker is not None else "a rollout worker"
    cause = getattr(err, "cause", None) or err
    return (f"{who}: {method.rsplit('.', 1)[-1]} failed: {type(cause).__name__}: "
            f"{first_line(cause)}")


def first_line(err: Exception) -> str:
    """An error's first line, cut at 300 characters (its type when it has no text)."""
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
