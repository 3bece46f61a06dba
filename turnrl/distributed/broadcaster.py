"""The learner's side of ``ray.weight_sync: broadcast`` (rank 0 of the weight group).

weight_sync.py explains the design; ``Fleet`` (fleet.py) decides when to form the group, and
``WeightPublisher`` (publisher.py) forms it and falls back to the object store when this says
a version did not go through.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from turnrl.distributed.weight_sync import (
    PREFIX,
    WeightGroupError,
    check_group,
    choose_backend,
    close_group,
    device_identity,
    first_line,
    flatten,
    new_group,
    plan_layout,
)

ANSWER_WAIT_S = 10.0
"""After a failed formation: how long to wait for the workers to say why they did not join."""
NO_MEMBERS = "no worker to send to: none was up when the weight group last formed"
"""Why ``send`` sent nothing when every worker was restarting or down at the last ``form``."""


class WeightBroadcaster:
    """Forms the weight group with the workers it is given and broadcasts versions to them."""

    def __init__(self, timeout_s: float, address: str = "") -> None:
        self.timeout_s = timeout_s
        self.address = address
        """What the workers connect to; '' = the learner's node IP in Ray."""
        self.group: Any = None
        self.store: Any = None
        self.handles: dict[int, Any] = {}
        self.members: dict[int, str] = {}
        """Worker -> the incarnation that joined the current group."""
        self.generation = 0
        self.backend = ""
        self.device = torch.device("cpu")
        self.failure = ""
        """Why the last broadcast failed ('' when it did not)."""

    def form(self, ray: Any, handles: dict[int, Any], members: dict[int, str],
             learner_device: torch.device) -> None:
        """A new group of the learner and ``handles`` (worker -> actor); raises
        ``WeightGroupError`` in one line when it cannot form within the timeout."""
        import torch.distributed as dist

        self.close()
        kinds = self._devices(ray, handles)
        workers = sorted(kinds)
        if not workers:  # every one is restarting: the object store carries this version, and
            return  # ``send`` says why (``NO_MEMBERS``)
        backend = choose_backend(device_identity(learner_device), kinds)
        device = learner_device if backend == "nccl" else torch.device("cpu")
        world, timeout = len(workers) + 1, timedelta(seconds=self.timeout_s)
        self.generation += 1
        # Bound on every interface, port chosen free by the OS, reached at ``address``.
        store = dist.TCPStore("0.0.0.0", 0, world, True, timeout=timeout, wait_for_workers=False)
        address = self.address or ray.util.get_node_ip_address()
        refs = {w: handles[w].join_weight_group.remote(address, store.port, rank, world, backend,
                                                       self.generation, self.timeout_s)
                for rank, w in enumerate(workers, start=1)}
        group = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            group = new_group(store, f"{PREFIX}-{self.generation}/", 0, world, backend,
                              self.timeout_s)
            check_group(group, device, self.timeout_s)
            failed = _join_failures(ray, refs, self.timeout_s)
            if failed:
                raise WeightGroupError(failed)
        except Exception as err:  # noqa: BLE001 - one line, with the workers' own reasons
            close_group(group)  # formed but unusable: NCCL's communicator aborted, not leaked
            reasons = _join_failures(ray, refs, ANSWER_WAIT_S) or first_line(err)
            raise WeightGroupError(
                f"ray.weight_sync broadcast: the weight group (the learner and workers "
                f"{', '.join(map(str, workers))}, {backend} via {address}:{store.port}) did "
                f"not form within {self.timeout_s:g} s ({reasons}); the workers must reach that "
                "address and port: set --ray.weight_sync_address to one they reach and open "
                "the port, raise --ray.weight_sync_timeout_s, or use --ray.weight_sync "
                "object_store") from None
        self.group, self.store = group, store
        self.handles = {w: handles[w] for w in workers}
        self.members = {w: members[w] for w in workers}
        self.backend, self.device = backend, device

    def _devices(self, ray: Any, handles: dict[int, Any]) -> dict[int, tuple[str, str]]:
        """Where each worker keeps its weights, asked of all at once (at most one timeout in
        all); a worker restarting or gone is left out (it catches up through the object store,
        and joins when the group forms again)."""
        refs = {w: handles[w].weights_device.remote() for w in sorted(handles)}
        answers = _answers(ray, refs, self.timeout_s)
        silent = [w for w in refs if w not in answers]
        if silent:
            raise WeightGroupError(
                f"ray.weight_sync broadcast: {_named(silent)} did not say where "
                f"{'it keeps' if len(silent) == 1 else 'they keep'} weights within "
                f"{self.timeout_s:g} s; raise "
                "--ray.weight_sync_timeout_s or use --ray.weight_sync object_store")
        kinds = {}
        for w, answer in answers.items():
            if isinstance(answer, ray.exceptions.RayActorError):
                continue
            if isinstance(answer, BaseException):
                raise answer
            kinds[w] = tuple(answer)
        return kinds

    def send(self, version: int, state: dict[str, Any], fire: Any) -> bool:
        """Broadcast ``state`` as ``version`` to every member (``fire`` sends the receive
        calls); False when it did not go through (the group is then dropped)."""
        if self.group is None:  # formed with no worker up (each restarting or down)
            self.failure = NO_MEMBERS
            return False
        layout = plan_layout(state)
        flats = flatten(state, layout, self.device)
        for handle in self.handles.values():
            fire(handle.receive_weights.remote(version, self.generation, layout))
        try:
            for flat in flats:
                self.group.broadcast(flat, 0).wait(timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 - a member died mid-way: re-formed next time
            self.failure = first_line(err)
            self.close()
            return False
        self.failure = ""
        return True

    def close(self) -> None:
        close_group(self.group)
        self.group, self.store, self.handles, self.members = None, None, {}, {}


def _join_failures(ray: Any, refs: dict[int, Any], wait_s: float) -> str:
    """'worker 1: reason; worker 2: no answer' for the workers that did not join ('' if all
    did), waiting ``wait_s`` for all of them together."""
    answers = _answers(ray, refs, wait_s)
    failures = []
    for w in refs:
        answer = answers.get(w, "no answer")
        if isinstance(answer, BaseException):  # the call raised, or the worker died
            answer = first_line(answer)
        if answer:
            failures.append(f"worker {w}: {answer}")
    return "; ".join(failures)


def _named(workers: list[int]) -> str:
    """'worker 2' or 'workers 0, 1, 2'."""
    return f"worker{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))}"


def _answers(ray: Any, refs: dict[int, Any], wait_s: float) -> dict[int, Any]:
    """Worker -> its call's answer (or the exception it raised), for the calls in ``refs``
    that ended within ``wait_s``, waited for together: one bound in all, not one a worker."""
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
    ended = set(ready)
    answers: dict[int, Any] = {}
    for w, ref in refs.items():
        if ref in ended:
            try:
                answers[w] = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - the caller names or skips it
                answers[w] = err
    return answers
