"""``turnrl tinker`` driven by the real ``tinker`` client (0.38) over HTTP, on the tiny model:
training clients, losses as the client sends them, optim_step, sampler weights, sampling,
states, isolation and the client's own errors."""

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

tinker = pytest.importorskip("tinker")  # the tinker extra
from tinker import types  # noqa: E402

from turnrl.models import tiny_model  # noqa: E402
from turnrl.tinker.models import score  # noqa: E402

TEXT = "the cat sat on the mat. the cat sat on the mat."


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    out = tmp_path_factory.mktemp("tinker")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "turnrl", "tinker", "--model.name", "tiny", "--serve.port", "0",
         "--run.threads", "1", "--run.out_dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env)
    line = proc.stdout.readline()
    match = re.search(r"http://[\d.]+:\d+", line)
    assert match, f"no URL in the service's first line: {line!r}"
    yield match.group(0)
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def service(base_url):
    warnings.filterwarnings("ignore", category=FutureWarning)
    client = tinker.ServiceClient(base_url=base_url, api_key="tml-local")
    yield client
    # Finished before the service stops: its session heartbeat would otherwise fail for the
    # rest of this worker's tests, into their logs.
    client.close("success").result(timeout=60)


def _datum(ids, weights=None, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:],
                                       "weights": weights or [1.0] * (len(ids) - 1), **inputs})


def _logprobs(client, ids):
    out = client.forward([_datum(ids)], "cross_entropy").result()
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist())


def test_tokenizer_and_forward_equal_turnrls_learner(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    tokenizer = client.get_tokenizer()  # offline: the service's saved tokenizer directory
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    # a fresh adapter (B = 0) is the base model: forward equals TurnRL's own scoring of it
    model, ref_tokenizer = tiny_model()
    assert ref_tokenizer.encode(TEXT) == ids
    with torch.no_grad():
        expected = score(model, [ids], ref_tokenizer.pad_token_id)[0]
    assert torch.equal(_logprobs(client, ids), expected)


def test_cross_entropy_steps_lower_the_loss_and_lr_zero_changes_nothing(service):
    client = service.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    ids = client.get_tokenizer().encode(TEXT)
    before = _logprobs(client, ids)
    client.forward_backward([_datum(ids)], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=0.0)).result()
    assert torch.equal(_logprobs(client, ids), before)
    losses = []
    for _ in range(4):
        out = client.forward_backward([_datum(ids)], "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert losses[-1] < losses[0] - 1.0, losses
    assert losses[0] == pytest.approx(-before.sum().item(), rel=1e-5)


def test_sample_logprobs_equal_a_fresh_forward_of_the_saved_weights(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = client.get_tokenizer().encode(TEXT)
    client.forward_backward([_datum(ids)], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = ids[:5]
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                            types.SamplingParams(max_tokens=6, seed=3, stop=[])).result()
    assert len(result.sequences) == 2
    for seq in result.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        # the training client holds the same weights: its forward scores the same tokens
        full = _logprobs(client, prompt + list(seq.tokens))
        assert torch.equal(torch.tensor(seq.logprobs), full[len(prompt) - 1:])
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                           types.SamplingParams(max_tokens=6, seed=3, stop=[])).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    # the named path: save_weights_for_sampler, then a sampling client from that path
    path = client.save_weights_for_sampler("named").result().path
    named = service.create_sampling_client(model_path=path).result()
    same = named.sample(types.ModelInput.from_ints(prompt), 2,
                        types.SamplingParams(max_tokens=6, seed=3, stop=[])).result()
    assert [s.logprobs for s in same.sequences] == [s.logprobs for s in result.sequences]


def test_importance_sampling_and_ppo_take_the_clients_inputs(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = client.get_tokenizer().encode(TEXT)
    logprobs = _logprobs(client, ids).tolist()
    adv = [0.5] * len(logprobs)
    for loss in ("importance_sampling", "ppo"):
        out = client.forward_backward([_datum(ids, logprobs=logprobs, advantages=adv)],
                                      loss).result()
        # the sampler's log-probs are the policy's: ratio 1, loss = -sum(A)
        assert out.metrics["loss:sum"] == pytest.approx(-sum(adv), rel=1e-5)


def test_clients_never_see_each_others_adapters(service):
    first = service.create_lora_training_client(base_model="tiny", rank=4).result()
    second = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = first.get_tokenizer().encode(TEXT)
    untouched = _logprobs(second, ids)
    for _ in range(2):
        first.forward_backward([_datum(ids)], "cross_entropy").result()
        first.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert not torch.equal(_logprobs(first, ids), untouched)
    assert torch.equal(_logprobs(second, ids), untouched)


def test_a_saved_state_resumed_gives_the_same_next_step(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = client.get_tokenizer().encode(TEXT)

    def step():
        client.forward_backward([_datum(ids)], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    step()
    path = client.save_state("ckpt").result().path
    step()
    after = _logprobs(client, ids)
    client.load_state_with_optimizer(path).result()
    step()
    assert torch.equal(_logprobs(client, ids), after)
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward([_datum(ids)], "cross_entropy").result()
    resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert torch.equal(_logprobs(resumed, ids), after)


def test_bad_input_gets_the_clients_error_naming_what_is_missing(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = client.get_tokenizer().encode(TEXT)
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'dro'.*cross_entropy"):
        client.forward_backward([_datum(ids)], "dro").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs advantages"):
        client.forward_backward([_datum(ids, logprobs=[0.0] * (len(ids) - 1))],
                                "importance_sampling").result()
    with pytest.raises(tinker.RequestFailedError, match="'eps' is not an option of loss 'ppo'"):
        client.forward_backward([_datum(ids)], "ppo", {"eps": 0.2}).result()
    with pytest.raises(tinker.RequestFailedError, match="base_model 'no/such-model'"):
        service.create_lora_training_client(base_model="no/such-model", rank=4).result()


def test_forward_backward_custom_runs_the_clients_loss(service):
    client = service.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = client.get_tokenizer().encode(TEXT)
    before = _logprobs(client, ids)

    def mean_nll(data, logprobs_list):
        loss = -torch.stack([lp.mean() for lp in logprobs_list]).mean()
        return loss, {"nll": loss.item()}

    out = client.forward_backward_custom([_datum(ids)], mean_nll).result()
    assert out.metrics["nll"] == pytest.approx(-before.mean().item(), rel=1e-5)
    client.optim_step(types.AdamParams(learning_rate=5e-3)).result()
    assert _logprobs(client, ids).mean() > before.mean()


def test_an_api_key_set_on_the_service_is_required(tmp_path):
    from starlette.testclient import TestClient

    from turnrl.tinker.app import make_app
    from turnrl.tinker.service import Service

    http = TestClient(make_app(Service("tiny", tmp_path), api_key="tml-secret"))
    refused = http.post("/api/v1/create_session", json={})
    assert refused.status_code == 401 and "TINKER_API_KEY" in refused.json()["error"]
    assert http.post("/api/v1/create_session", json={},
                     headers={"X-API-Key": "tml-secret"}).status_code == 200


def test_sample_requests_waiting_together_are_drawn_together(tmp_path):
    """A recipe asks for each env of a group alone (``num_samples=1``, one prompt): requests
    that wait together for the same weights, prompt and parameters are drawn in one call,
    each answer its own rows, each row's log-probs a fresh forward's. A seeded request, and
    one queued after a request of another kind, are drawn alone."""
    import threading

    import numpy as np

    from turnrl.tinker.service import Service
    from turnrl.tinker.wire import pb

    service = Service("tiny", tmp_path)
    gate = threading.Event()
    service.submit(gate.wait)  # holds the worker: the requests below queue behind it
    prompt = service.bases["tiny"].tokenizer.encode(TEXT)[:6]
    body = {"base_model": "tiny", "prompt": {"chunks": [{"tokens": prompt}]}, "num_samples": 2,
            "sampling_params": {"max_tokens": 4, "stop": []}}
    try:
        together = [service.submit_sample(dict(body))["request_id"] for _ in range(3)]
        seeded = service.submit_sample({**body, "sampling_params": {"max_tokens": 4, "seed": 3,
                                                                    "stop": []}})
        service.submit(lambda: None)  # another kind of request: a new run
        after = service.submit_sample(dict(body))
    finally:
        gate.set()  # never leave the worker held (it would hold the test process at exit)
    model = service.bases["tiny"].model
    for request in [*together, seeded["request_id"], after["request_id"]]:
        answer = pb.SampleResponse.FromString(service.future(request).result(timeout=120))
        assert len(answer.sequences) == 2
        for seq in answer.sequences:
            tokens = np.frombuffer(seq.tokens, dtype=np.int32).tolist()
            logprobs = torch.from_numpy(np.frombuffer(seq.logprobs, dtype=np.float32).copy())
            with torch.no_grad():
                fresh = score(model, [prompt + tokens], service.bases["tiny"].pad_id)[0]
            assert len(tokens) == 4 and torch.equal(logprobs, fresh[len(prompt) - 1:])
    assert service.draws == 3  # the three together, the seeded one, the one after the barrier
    assert not service.runs._run  # the drawn requests are not kept
