"""A CTranslate2 engine: int8 (or float32) sampling on CPU, refreshed from the learner's weights.

Sampling on CPU is memory-bound: every decoded token reads all the weights once, so int8
weights (a quarter of fp32's bytes) decode faster where the learner stays fp32. CTranslate2
(the ``ct2`` extra) has CPU wheels and int8 GEMMs; ``benchmarks/speed/ct2_sampling.py`` measures it
against ``HFEngine`` and docs/samplers.md says when to use which.

Choices:

- Weights. ``load`` converts the learner's tensors in process: the model's class is
  built empty (on the meta device) around them, CTranslate2's own Transformers loader turns
  it into a model spec (fusing q/k/v, its own layout), the spec is quantised and saved to a
  folder in ``/dev/shm`` (memory, not disk) and a new ``ctranslate2.Generator`` loads it. The
  learner's modules are never handed to the loader: it deletes each layer's submodules as it
  goes. Only architectures CTranslate2 has a loader for work (Llama, SmolLM2, Qwen2,
  Mistral, ...); another fails at start-up naming the configuration class.
- Token ids. The converted vocabulary is the token ids themselves (``"0"``, ``"1"``, ...), so
  prompts go in as ids and nothing is ever detokenised; an id past the vocabulary is refused
  (CTranslate2 would silently read it as its unknown token).
- Log-probabilities. CTranslate2 reports each sampled token's log-probability under the
  *unscaled* logits (temperature 1, before top-p truncation). The ``Engine`` contract is the
  temperature-scaled policy, so for a temperature T != 1 the output layer is converted divided
  by T and sampled at temperature 1: the reported log-probability is then exactly
  ``log_softmax(logits / T)``, before top-p, as ``HFEngine`` reports. One converted model is
  kept per temperature in use (training's and evaluation's), each converted on first use after
  an update from the learner's tensors as they are then (in lock-step runs nothing changes
  them between an update and the next). Greedy (temperature 0) reports log-probabilities at
  temperature 1, as ``HFEngine`` does.
- Stopping. Only ``SamplingParams.stop_token_ids`` end a completion (never the model's own
  end-of-sequence token); the stop token is part of the completion, as in ``HFEngine``.
- No cache between calls: each call prefills its prompts whole (CTranslate2 keeps no keys and
  values across calls), so a multi-turn episode re-reads its history every turn.
- Randomness. CTranslate2 draws from its own global generator, seeded before every call from
  ``self.generator`` (a ``torch.Generator``, saved with checkpoints like ``HFEngine``'s), so a
  resumed run draws the same seeds.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from turnrl.config.precision import (
    DEFAULT_CT2_DTYPE,
    load_ctranslate2,
    resolve_ct2_dtype,
)
from turnrl.samplers.base import Completion, SamplingParams
from turnrl.samplers.vllm import WeightsLike, named_tensors, with_tied_output


def quantization_of(compute_type: str) -> str:
    """How the saved weights are stored for a compute type (CTranslate2 converts on load)."""
    return "float32" if compute_type == "bfloat16" else compute_type


@cache
def _loaders() -> dict[str, Any]:
    """CTranslate2's per-architecture Transformers loaders, by configuration class name. Its
    public ``TransformersConverter`` takes a path and loads the model again with
    ``from_pretrained`` (the issue measured 28 s for SmolLM2); the loaders take a model
    object, so the learner's tensors are converted in process."""
    from ctranslate2.converters.transformers import _MODEL_LOADERS

    return _MODEL_LOADERS


def check_architecture(config: Any, key: str = "rollout.sampler") -> None:
    """Fail in one line unless CTranslate2 converts the model's configuration to a decoder-only
    language model (it also converts encoders and encoder-decoders, which cannot sample
    here). ``key`` names the option that asked for ct2."""
    load_ctranslate2()
    name = type(config).__name__
    loader = _loaders().get(name)
    architecture = getattr(loader, "architecture_name", None) or ""
    if not architecture.endswith(("ForCausalLM", "LMHeadModel")):  # a decoder-only LM
        raise ValueError(f"{key} ct2 cannot convert {name} models (CTranslate2 "
                         f"converts Llama, Qwen2, Mistral, Gemma, ...); use --{key} hf")


class _IdVocabulary:
    """Stands in for the tokenizer in CTranslate2's loader: token i is the string ``str(i)``."""

    def __init__(self, size: int, bos_token_id: int | None, eos_token_id: int | None):
        self.size = size
        self.bos_token = str(bos_token_id if bos_token_id is not None else 0)
        self.eos_token = str(eos_token_id if isinstance(eos_token_id, int) else 0)
        self.unk_token = ""

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.size)}


def _first_id(value: Any) -> int | None:
    return value[0] if isinstance(value, list | tuple) and value else value


def private_copies(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A copy of every tensor, one per name, tied ones too. CTranslate2's quantisation scales
    the arrays it is given in place: handed the learner's own tensors, int8 conversion
    rewrote them (its log-probs then off by hundreds of nats); handed one copy under two
    names (a tied output layer), it scaled that copy twice."""
    return {name: tensor.detach().clone() for name, tensor in pairs}


def convert(model_class: type, config: Any, weights: WeightsLike, folder: str,
            compute_type: str, temperature: float = 1.0) -> None:
    """Write the CTranslate2 model of ``weights`` (Hugging Face names) to ``folder``, the
    output layer divided by ``temperature``. ``weights`` are copied first, never modified."""
    pairs = with_tied_output(named_tensors(weights, to_cpu=True),
                             bool(getattr(config, "tie_word_embeddings", False)))
    with torch.device("meta"):
        shell = model_class(config)  # no memory: the copies are assigned below
    shell.load_state_dict(private_copies(pairs), strict=True, assign=True)
    vocabulary = _IdVocabulary(config.vocab_size, _first_id(config.bos_token_id),
                               _first_id(config.eos_token_id))
    with torch.no_grad(), _cheap_gc():
        spec = _loaders()[type(config).__name__](shell, vocabulary)
        if temperature != 1.0:
            projection = spec.decoder.projection
            projection.weight = projection.weight / temperature
            if isinstance(getattr(projection, "bias", None), torch.Tensor):
                projection.bias = projection.bias / temperature
    spec.validate()
    quantize_only(spec, quantization_of(compute_type))
    spec.save(folder)


@contextmanager
def _cheap_gc() -> Iterator[None]:
    """CTranslate2's loaders call ``gc.collect()`` after each layer, which walks every object
    of the process (a trainer's are many): 24 of 41 s converting SmolLM2 at load 11. Objects
    that exist before the conversion are frozen out of those walks meanwhile."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def quantize_only(spec: Any, quantization: str) -> None:
    """``spec.optimize`` without its first pass, which looks for duplicate tensors to store
    once by comparing every pair of same-shaped ones element by element: 22,000 comparisons,
    12 of 17 CPU-seconds converting SmolLM2. Without it a tied output layer is stored twice
    (SmolLM2: 28 MB more in int8; ``private_copies`` gives it its own copy, which the
    in-place quantisation needs anyway); nothing else is shared. Falls back to ``optimize`` where
    this CTranslate2 has no separate quantisation step."""
    quantize = getattr(spec, "_quantize", None)
    if quantize is None:
        spec.optimize(quantization=quantization)
    else:
        quantize(quantization)


class CT2Engine:
    """Samples with CTranslate2 from the learner's weights, converted at each update; implements
    the ``Engine`` protocol (see the module docstring for the choices).

    ``model`` gives the architecture and the first weights (its tensors, converted on first
    use; later versions come through ``load``). ``compute_type`` is CTranslate2's (``int8``, ``int8_float32``,
    ``float32``, ``bfloat16`` where the CPU has it); ``threads`` defaults to torch's count.
    """

    def __init__(self, model: torch.nn.Module, *, compute_type: str = DEFAULT_CT2_DTYPE,
                 seed: int = 0, threads: int | None = None, version: int = 0):
        self._ct2 = load_ctranslate2()
        check_architecture(model.config)
        self.compute_type = resolve_ct2_dtype(compute_type)
        self.threads = threads or torch.get_num_threads()
        self._model_class, self._config = type(model), model.config
        self.vocab_size = int(model.config.vocab_size)
        self.generator = torch.Generator().manual_seed(seed)
        self._root = tempfile.mkdtemp(prefix="turnrl-ct2-", dir=_scratch_dir())
        # removed when the engine goes or the interpreter exits (__del__ may never run then)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        self._generators: dict[float, Any] = {}
        self._weights: WeightsLike = model.state_dict()  # converted on first use
        self.version = version

    def describe(self) -> str:
        """What samples, for the ``sampler:`` start-up line."""
        return f"ct2 {self.compute_type} on cpu ({self.threads} threads)"

    def release(self, sequences: Sequence[Sequence[int]]) -> None:
        """Nothing to forget: CTranslate2 keeps no keys or values between calls."""

    def load(self, weights: WeightsLike, version: int) -> None:
        """Adopt the learner's weights (a state dict or ``(name, tensor)`` pairs) as
        ``version``: the temperature sampled last is converted now, others on first use
        (before any sampling, nothing is: a run publishes its first weights right after
        building the engine, and those would be converted twice)."""
        self._weights = weights if isinstance(weights, dict) else dict(weights)
        recent = list(self._generators)
        self._generators.clear()
        self.version = version
        if recent:
            self._generator_at(recent[-1])

    def _generator_at(self, temperature: float) -> Any:
        """The loaded model whose output layer is divided by ``temperature``."""
        if temperature in self._generators:
            self._generators[temperature] = self._generators.pop(temperature)  # most recent
            return self._generators[temperature]
        self._generators[temperature] = self.build(self._weights, temperature)
        return self._generators[temperature]

    def build(self, weights: WeightsLike, temperature: float) -> Any:
        """A loaded CTranslate2 model of ``weights``, its output layer divided by
        ``temperature``. Touches no state of the engine, so another thread may build the next
        version while this one samples (async rollout workers, ``ct2_refresh``)."""
        folder = tempfile.mkdtemp(prefix=f"T{temperature!r}-", dir=self._root)
        try:
            convert(self._model_class, self._config, weights, folder, self.compute_type,
                    temperature)
            return self._ct2.Generator(folder, device="cpu", compute_type=self.compute_type,
                                       intra_threads=self.threads)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # loaded (or failed): no longer needed

    def adopt(self, weights: WeightsLike, version: int, temperature: float,
              generator: Any) -> None:
        """Sample as ``version`` from now on with ``generator`` (``build(weights,
        temperature)``); another temperature is converted from ``weights`` on first use."""
        self._weights = weights
        self._generators = {temperature: generator}
        self.version = version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[Completion]:
        if not prompts:
            return []
        self._check_prompts(prompts)
        if params.max_new_tokens < 1:
            return [Completion() for _ in prompts]
        greedy = params.temperature == 0
        generator = self._generator_at(converted_temperature(params.temperature))
        sampling = (dict(sampling_topk=1) if greedy else
                    dict(sampling_topk=0, sampling_topp=params.top_p, sampling_temperature=1.0))
        steps: list[list[tuple[int, float]]] = [[] for _ in prompts]

        def collect(step: Any) -> bool:
            steps[step.batch_id].append((step.token_id, step.log_prob))
            return False

        self._ct2.set_random_seed(int(torch.randint(2**31 - 1, (1,), generator=self.generator)))
        generator.generate_batch(
            [[str(t) for t in prompt] for prompt in prompts],
            max_length=params.max_new_tokens, include_prompt_in_result=False,
            end_token=[str(t) for t in params.stop_token_ids], return_end_token=True,
            return_scores=True,  # makes the callback carry each token's log-probability
            callback=collect, **sampling)
        stop = set(params.stop_token_ids)
        return [_completion(row, stop) for row in steps]

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        for prompt in prompts:
            if not prompt:
                raise ValueError("CT2Engine.generate got an empty prompt")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
                raise ValueError(f"token id {bad} is outside the model's vocabulary "
                                 f"(0..{self.vocab_size - 1})")

    def close(self) -> None:
        """Free the loaded models and their scratch folder."""
        self._generators.clear()
        self._cleanup()


def converted_temperature(temperature: float) -> float:
    """The temperature a model is converted at for sampling at ``temperature``: greedy
    decoding (0) reads temperature-1 log-probabilities, as ``HFEngine`` reports them."""
    return 1.0 if temperature == 0 else float(temperature)


def _completion(steps: list[tuple[int, float]], stop: set[int]) -> Completion:
    tokens = [token for token, _ in steps]
    finished = bool(tokens) and tokens[-1] in stop
    return Completion(token_ids=tokens, logprobs=[float(lp) for _, lp in steps],
                      finish_reason="stop" if finished else "length")


def _scratch_dir() -> str | None:
    """Memory-backed ``/dev/shm`` where it exists (converted models are written and read back
    once per update), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
