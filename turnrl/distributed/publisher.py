"""The learner's side of shipping weights to the rollout workers: the newest published
version, sent through the weight group (``ray.weight_sync: broadcast``, broadcaster.py) or put
in the object store once for whoever needs it, and the bytes each node pulled from the store.
``Fleet`` (fleet.py) decides who needs what; this holds the version and how it travels."""

from __future__ import annotations

import logging

import torch

from turnrl.distributed.worker_engines import without_tied_weights
from turnrl.learner.weights import published_state
from turnrl.lora import state_bytes

FORM_TRIES = 3
"""Mid-run, the weight group may fail to form this many times in a row before the run gives
it up and uses the object store alone."""
log = logging.getLogger("turnrl.worker")


def group_members(up: list[int], incarnation: dict[int, str]) -> dict[int, str]:
    """The workers the weight group should hold now: up, with a known incarnation."""
    return {w: incarnation[w] for w in up if w in incarnation}


class WeightPublisher:
    """The newest published version (its tensors, and an object-store copy put only when a
    worker outside the weight group or the opponent pool needs one), the weight group, and
    the bytes Ray pulled to each node."""

    def __init__(self, ray, broadcaster=None) -> None:
        self.ray = ray
        self.newest: tuple[int, object] | None = None
        """(version, ObjectRef of its state dict, None until one is needed)."""
        self.state: dict | None = None
        self.learner_device = torch.device("cpu")
        self.version_bytes = 0
        """Tensor bytes of the newest published version (a LoRA run: the adapter's)."""
        self.published_bytes: dict[int, int] = {}
        """Version -> bytes of its published state dict (the last few versions)."""
        self.node_versions: dict[str, set[int]] = {}
        """Node id -> the versions its workers have loaded: Ray pulls an object into a node's
        store once, and every worker there reads that copy."""
        self.pulled: dict[str, int] = {}
        """Node label -> weight bytes pulled to it since the learner last looked."""
        self.broadcaster = broadcaster
        """``ray.weight_sync: broadcast``: the learner's side of the weight group (None: the
        object store carries every version). Formed once the workers have started."""
        self.form_failures = 0
        """Failed formations in a row mid-run; ``FORM_TRIES`` of them end broadcasting."""
        self.broadcast_versions: list[int] = []
        """Versions that went through the weight group (the rest: the object store)."""

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """``version`` is the newest: its live tensors, put in the object store only if a
        worker outside the group needs it (the learner's loop leaves them unchanged until the
        next publish, and every catch-up happens while collecting)."""
        # Tied tensors are found on the model's device (copies to the CPU no longer alias).
        # LoRA: the adapter's tensors alone (``published_state``), a fraction of the model.
        state = without_tied_weights(published_state(model))
        self.learner_device = next(model.parameters()).device
        self.version_bytes = state_bytes(state)
        self.published_bytes[version] = state_bytes(state)
        for old in [v for v in self.published_bytes if v < version - 16]:
            del self.published_bytes[old]
        self.state, self.newest = state, (version, None)

    def form(self, handles: list, members: dict[int, str]) -> None:
        """Form the weight group of ``members`` (worker -> incarnation)."""
        self.broadcaster.form(self.ray, {w: handles[w] for w in members}, members,
                              self.learner_device)

    def broadcast(self, version: int, handles: list, members: dict[int, str],
                  fire) -> list[int]:
        """Send ``version`` through the weight group, formed again first when its members
        changed; the workers it reached (none: the object store carries it)."""
        broadcaster = self.broadcaster
        if broadcaster is None or broadcaster.generation == 0:
            return []  # object store mode, or the start version while the workers build
        if broadcaster.members != members:
            try:
                self.form(handles, members)
                self.form_failures = 0
            except RuntimeError as err:
                self.form_failures += 1
                if self.form_failures < FORM_TRIES:
                    log.warning("%s; version %d goes through the object store", err, version)
                    return []
                log.warning("%s; the object store carries every version from now on", err)
                self.broadcaster = None
                return []
        if not broadcaster.send(version, self.state, fire):
            log.warning("the broadcast of version %d failed (%s): it goes through the object "
                        "store; the weight group forms again at the next version",
                        version, broadcaster.failure)
            return []
        self.broadcast_versions.append(version)
        return list(broadcaster.members)

    def ref(self) -> object:
        """The newest version in the object store, put there once for all who need it (a
        worker outside the weight group, the opponent pool)."""
        version, ref = self.newest
        if ref is None:
            cpu = {k: v.to("cpu") if torch.is_tensor(v) else v for k, v in self.state.items()}
            ref = self.ray.put(cpu)
            self.newest = (version, ref)
        return ref

    def count_pull(self, node: tuple[str, str], version: int) -> None:
        """Weight bytes pulled to ``node`` (id, label) by a worker that loaded ``version``:
        that version's first load on the node, through the object store."""
        node_id, label = node
        seen = self.node_versions.setdefault(node_id, set())
        if version in seen or version not in self.published_bytes \
                or version in self.broadcast_versions[-32:]:  # not through the object store
            return
        seen.add(version)
        seen.difference_update([v for v in seen if v not in self.published_bytes])
        self.pulled[f"{label} {node_id[:8]}"] = (self.pulled.get(f"{label} {node_id[:8]}", 0)
                                                  + self.published_bytes[version])

    def take_pulled(self, nodes: set[str]) -> dict[str, int]:
        """Weight bytes pulled per node since the last call: each of ``nodes`` (those that
        have workers) and any other that pulled."""
        pulled = {node: self.pulled.get(node, 0) for node in nodes | set(self.pulled)}
        self.pulled = {}
        return pulled

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
