"""The binary half of Tinker's wire format: ``forward_backward`` requests arrive as the
client's protobuf (``tinker.proto.tinker_public_pb2``), and forward_backward outputs and
sample results go back as protobuf when the client asks (``Accept: application/x-protobuf``).
The messages are the client package's own generated classes, so the two sides share one
schema; everything else on the wire is JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb  # the tinker extra: pip install 'turnrl[tinker]'

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One training example: the input tokens and the loss inputs by name ([N] tensors)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class FwdBwd:
    model_id: str
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(msg: pb.Tensor) -> torch.Tensor:
    """A dense tensor from a proto ``Tensor`` (a sparse CSR one is densified with zeros)."""
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"tensor dtype {msg.dtype} is not one this service reads "
                         "(float32, int64, int32)")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        return torch.sparse_csr_tensor(
            torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy()), shape).to_dense()
    array = np.frombuffer(msg.dense, dtype=dtype).copy()
    return torch.from_numpy(array.reshape(shape) if shape else array)


def _tokens(chunks) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"model_input chunk '{kind}' is not supported: this service "
                             "trains text models (send EncodedTextChunk tokens)")
        tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
    return tokens


def read_forward_backward(body: bytes) -> FwdBwd:
    """The client's ``ForwardBackwardRequest`` (already un-zstd'ed) as plain values."""
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [Datum(_tokens(d.model_input), {k: _tensor(t) for k, t in d.loss_fn_inputs.items()})
            for d in msg.data]
    return FwdBwd(msg.model_id, msg.loss_fn, config, msg.forward_only, data)


def forward_backward_output(per_datum: list[dict[str, torch.Tensor]],
                            metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ArrayRecord with each field's per-datum float32
    arrays concatenated, sliced by byte offsets."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics.update(metrics)
    record = out.loss_fn_outputs.add(num_datums=len(per_datum), type_tag="ArrayRecord")
    for name in (per_datum[0] if per_datum else {}):
        arrays = [d[name].detach().float().cpu().numpy().astype(np.float32) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
            dtype=pb.DTYPE_FLOAT32))
    return out.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse``: (tokens, logprobs, 'stop'|'length') per sequence; prompt
    log-probs (NaN for the first token) when asked."""
    out = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        out.sequences.add(
            tokens=np.asarray(tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(logprobs, dtype=np.float32).tobytes(),
            stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH)
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
