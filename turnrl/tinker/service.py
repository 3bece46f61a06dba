"""The Tinker service's state: sessions, one ``TrainingModel`` per training client, saved
sampler weights and states by ``tinker://`` path, and futures.

Every request that touches a model runs on one worker thread in arrival order, so a
client's forward_backward always precedes its optim_step and two clients never interleave
inside a step; HTTP handlers only enqueue and return a request id, which the client polls
(``retrieve_future``). A failed request's future holds a ``RequestError`` that the client
raises as its own ``RequestFailedError`` with the message.
"""

from __future__ import annotations

import itertools
import re
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from turnrl.lora import load_adapter_state
from turnrl.models import SMOLLM2, load_model
from turnrl.tinker import sampling
from turnrl.tinker.batching import Pending, SampleRuns, merge_key
from turnrl.tinker.losses import LOSSES
from turnrl.tinker.models import TrainingModel
from turnrl.tinker.wire import FwdBwd, forward_backward_output, sample_response

ALIASES = {"HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2}


def model_name(body: dict) -> str:
    """A new training model's id as the client derives it: SESSION:train:SEQ."""
    return f"{body['session_id']}:train:{body['model_seq_id']}"


class RequestError(Exception):
    """A request the client got wrong: the message names what is missing and the fix."""


class Base:
    """A loaded base model, its tokenizer and where that tokenizer is saved for clients."""

    def __init__(self, name: str, tokenizer_dir: Path, dtype: str, cache_dir: str):
        model, self.tokenizer = load_model(ALIASES.get(name, name), dtype=dtype,
                                           cache_dir=cache_dir or None)
        self.model = model.train(False).requires_grad_(False)
        self.name = name
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer.save_pretrained(str(tokenizer_dir))
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.samplers: dict[tuple, TrainingModel] = {}  # one per adapter shape, reloaded

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)


class Service:
    def __init__(self, model_name: str, out_dir: Path, dtype: str = "float32",
                 cache_dir: str = ""):
        self.out_dir, self.dtype, self.cache_dir = Path(out_dir), dtype, cache_dir
        self.bases: dict[str, Base] = {}
        self.default_model = model_name
        self.base(model_name)  # load (and convert) the served model at start-up
        self.sessions: set[str] = set()
        self.models: dict[str, tuple[str, TrainingModel]] = {}
        self.saved: dict[str, tuple[str, TrainingModel | None, dict | None]] = {}
        self.sampling_sessions: dict[str, str] = {}  # id -> tinker path or base model name
        self.futures: dict[str, Future] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker")
        self._ids = itertools.count(1)
        self.runs = SampleRuns()
        self.draws = 0
        """Draw calls made (a merged group of sample requests counts once)."""

    # --- futures --------------------------------------------------------------------------
    def submit(self, fn, *args, barrier: bool = True) -> dict:
        """Queue ``fn(*args)`` on the worker; the client polls the returned request id."""
        if barrier:
            self.runs.barrier()
        request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self.futures[request_id] = self.worker.submit(fn, *args)
        return {"request_id": request_id}

    def submit_sample(self, body: dict) -> dict:
        """Queue a sample request, which may be drawn with others waiting beside it
        (batching.py)."""
        try:
            key = merge_key(body, self._target(body))
        except (RequestError, KeyError, TypeError):
            key = None  # drawn alone, where the request answers its own error
        return self.submit(self._run_sample, self.runs.add(body, key), barrier=False)

    def future(self, request_id: str) -> Future:
        if request_id not in self.futures:
            raise RequestError(f"no request '{request_id}' on this service (futures live as "
                               "long as the service process)")
        return self.futures[request_id]

    # --- models -----------------------------------------------------------------------------
    def base(self, name: str) -> Base:
        if name not in self.bases:
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
            try:
                self.bases[name] = Base(name, self.out_dir / "tokenizers" / safe, self.dtype,
                                        self.cache_dir)
            except (FileNotFoundError, OSError, ValueError) as err:
                raise RequestError(f"base_model '{name}' is not available offline here "
                                   f"({str(err).splitlines()[0]}); this service has "
                                   f"{', '.join(self.bases)}") from None
        return self.bases[name]

    def training(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise RequestError(f"no training model '{model_id}' (create one with "
                               "create_lora_training_client)")
        return self.models[model_id][1]

    def create_model(self, body: dict) -> dict:
        base = self.base(body["base_model"])
        lora = body.get("lora_config") or {}
        if not lora.get("rank"):
            raise RequestError("create_model needs lora_config.rank >= 1: this service "
                               "trains LoRA adapters only")
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(f"optimizer '{optimizer}' is not supported (this service "
                               "runs adamw)")
        model = TrainingModel(base.model, base.pad_id, int(lora["rank"]), lora.get("seed"),
                              attn=lora.get("train_attn", True), mlp=lora.get("train_mlp", True))
        model_id = model_name(body)
        self.models[model_id] = (base.name, model)
        return {"model_id": model_id, "type": "create_model"}

    def get_info(self, model_id: str) -> dict:
        name, model = self.models.get(model_id) or (None, None)
        if model is None:
            raise RequestError(f"no training model '{model_id}'")
        base = self.bases[name]
        return {"type": "get_info", "model_id": model_id, "model_name": name,
                "is_lora": True, "lora_rank": model.spec.r,
                "model_data": {"arch": type(base.model).__name__, "model_name": name,
                               "tokenizer_id": str(base.tokenizer_dir)}}

    # --- training ---------------------------------------------------------------------------
    def forward_backward(self, request: FwdBwd) -> bytes:
        model = self.training(request.model_id)
        if request.loss_fn not in LOSSES:
            raise RequestError(f"unknown loss_fn '{request.loss_fn}': this service has "
                               f"{', '.join(LOSSES)} (forward_backward_custom runs others)")
        try:
            outputs, metrics = model.forward_backward(request.data, request.loss_fn,
                                                      request.config, request.forward_only)
        except ValueError as err:
            raise RequestError(str(err)) from None
        return forward_backward_output(outputs, metrics)

    def optim_step(self, body: dict) -> dict:
        model = self.training(body["model_id"])
        params = body.get("adam_params") or body.get("optim_params")
        if params is None:
            kind = (body.get("optimizer_params") or {}).get("type")
            raise RequestError(f"optimizer params '{kind}' are not supported: send AdamParams")
        metrics = model.optim_step(
            float(params.get("learning_rate", 1e-4)),
            (float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95))),
            float(params.get("eps", 1e-12)), float(params.get("weight_decay", 0.0)),
            float(params.get("grad_clip_norm", 0.0)))
        return {"metrics": metrics}

    # --- weights ----------------------------------------------------------------------------
    def save_for_sampler(self, body: dict) -> dict:
        model_id = body["model_id"]
        name, model = self.models[model_id][0], self.training(model_id)
        label = body.get("path") or f"sampler-{next(self._ids)}"
        path = f"tinker://{model_id}/sampler_weights/{label}"
        self.saved[path] = (name, model, model.adapter())
        if body.get("path"):
            return {"path": path, "type": "save_weights_for_sampler"}
        session = self.new_sampling_session(path)
        return {"path": path, "sampling_session_id": session, "type": "save_weights_for_sampler"}

    def save_state(self, body: dict) -> dict:
        model_id = body["model_id"]
        model = self.training(model_id)
        path = f"tinker://{model_id}/weights/{body.get('path') or next(self._ids)}"
        self.saved[path] = (self.models[model_id][0], None, model.state())
        return {"path": path, "type": "save_weights"}

    def load_state(self, body: dict) -> dict:
        path = body["path"]
        if path not in self.saved or self.saved[path][2] is None or "/weights/" not in path:
            raise RequestError(f"no saved state at '{path}' (save_state gives such paths)")
        name, _, state = self.saved[path]
        model_id = body.get("model_id")
        if model_id is None:  # create_training_client_from_state: a new client from the state
            base = self.base(name)
            model_id = model_name(body)
            self.models[model_id] = (name, TrainingModel(base.model, base.pad_id, state["rank"],
                                                         0, targets=state["targets"]))
        self.training(model_id).load_state(state, bool(body.get("optimizer")))
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    # --- sampling ---------------------------------------------------------------------------
    def new_sampling_session(self, target: str) -> str:
        if target not in self.saved:
            self.base(target)
        session = f"sampler-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session] = target
        return session

    def sampler_info(self, session: str) -> dict:
        if session not in self.sampling_sessions:
            raise RequestError(f"no sampling session '{session}'")
        target = self.sampling_sessions[session]
        saved = self.saved.get(target)
        return {"sampler_id": session, "base_model": saved[0] if saved else target,
                "model_path": target if saved else None}

    def sampler(self, target: str) -> tuple[Base, torch.nn.Module]:
        """The model a sampling target names: a base model, or a copy of the adapter's
        shape on that base with the saved adapter loaded."""
        if target not in self.saved:
            base = self.base(target)
            return base, base.model
        name, trained, adapter = self.saved[target]
        base = self.bases[name]
        key = (trained.spec.r, trained.spec.target_modules)
        if key not in base.samplers:
            base.samplers[key] = TrainingModel(base.model, base.pad_id, trained.spec.r, 0,
                                               targets=trained.spec.target_modules)
        model = base.samplers[key]
        load_adapter_state(model.model, adapter)
        return base, model.model

    def _target(self, body: dict) -> str:
        target = (self.sampling_sessions.get(body.get("sampling_session_id") or "")
                  or body.get("model_path") or body.get("base_model"))
        if not target:
            raise RequestError("sample needs a sampling_session_id, model_path or base_model")
        if target.startswith("tinker://") and target not in self.saved:
            raise RequestError(f"no sampler weights at '{target}' (save_weights_for_sampler "
                               "gives such paths)")
        return target

    def _run_sample(self, pending: Pending) -> bytes:
        group = self.runs.take(pending)
        if group:
            try:
                for p, answer in zip(group, self.sample_together([p.body for p in group]),
                                     strict=True):
                    p.result.set_result(answer)
            except BaseException as err:  # noqa: BLE001 - each request answers the error
                for p in group:
                    p.result.set_exception(err)
        return pending.result.result()

    def sample_together(self, bodies: list[dict]) -> list[bytes]:
        """One draw for ``bodies`` (the same target, prompt and parameters when several),
        split back into each request's ``num_samples``."""
        body = bodies[0]
        base, model = self.sampler(self._target(body))
        prompt = [t for chunk in body["prompt"]["chunks"] for t in chunk["tokens"]]
        counts = [int(b.get("num_samples", 1)) for b in bodies]
        self.draws += 1
        sequences, prompt_lps = sampling.sample(
            model, prompt, sum(counts), body.get("sampling_params") or {},
            base.tokenizer.eos_token_id, base.decode, base.pad_id,
            bool(body.get("prompt_logprobs")))
        starts = list(itertools.accumulate(counts, initial=0))
        return [sample_response(sequences[a:b], prompt_lps)
                for a, b in itertools.pairwise(starts)]
