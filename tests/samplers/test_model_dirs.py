"""Temporary model directories saved for vLLM (turnrl/samplers/model_dirs.py): removed with
their engine, at a normal exit, and, when their process died without either (a worker Ray
killed or restarted), by the next one made on the machine. Real processes, real files."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.samplers.model_dirs import (
    PREFIX,
    orphaned_model_dirs,
    remove_with,
    save_model_dir,
)


def _write(path: Path) -> None:
    (path / "config.json").write_text("{}")


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


class Engine:
    """What owns a saved directory (a ``VLLMEngine`` in a run)."""


def test_a_saved_directory_goes_with_its_engine_or_when_its_cleanup_is_called(tmp_path):
    engine = Engine()
    path = save_model_dir("0", _write, tmp_path)
    assert path.name.startswith(f"{PREFIX}0-p{os.getpid()}-") and (path / "config.json").exists()
    remove_with(engine, path)
    assert path.exists()
    del engine
    gc.collect()
    assert not path.exists()
    other, engine = save_model_dir("1", _write, tmp_path), Engine()
    cleanup = remove_with(engine, other)
    cleanup()  # a worker's stop
    assert not other.exists()
    cleanup()  # once only: no error the second time


def test_a_save_that_fails_leaves_no_directory(tmp_path):
    def broken(path: Path) -> None:
        _write(path)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_model_dir("0", broken, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_normal_exit_removes_the_directory_of_a_live_engine(tmp_path):
    code = ("import sys; from pathlib import Path;"
            "from turnrl.samplers.model_dirs import remove_with, save_model_dir\n"
            "class Engine: pass\n"
            "engine = Engine()\n"
            f"path = save_model_dir('sync', lambda p: (p / 'w').write_text('x'), {str(tmp_path)!r})\n"
            "remove_with(engine, path)\n"
            "print(path)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert done.stdout.strip().startswith(str(tmp_path / PREFIX))
    assert not Path(done.stdout.strip()).exists()


def test_directories_of_processes_that_are_gone_are_removed_by_the_next_save(tmp_path):
    dead = _dead_pid()
    orphans = [tmp_path / f"{PREFIX}{label}-p{dead}-{suffix}"
               for label, suffix in (("0", "ab12_cd"), ("sync", "zz9"))]
    live = [tmp_path / f"{PREFIX}1-p{os.getpid()}-abc", tmp_path / f"{PREFIX}2-p{os.getppid()}-x"]
    other = [tmp_path / f"{PREFIX}3-abcdef", tmp_path / "unrelated-p1-abc"]  # names not ours
    for path in orphans + live + other:
        path.mkdir()
        _write(path)
    assert orphaned_model_dirs(tmp_path) == sorted(orphans)
    made = save_model_dir("4", _write, tmp_path)
    assert not any(p.exists() for p in orphans)
    assert all(p.exists() for p in live + other + [made])


# ---- the engines that save the tiny model (vLLM is not on this machine: a stand-in records
# what it is given, and can fail to start; the real one runs in tests/gpu/test_async_vllm_gpu.py)

TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--run.progress", "false",
        "--run.tensorboard", "false"]


def _standin(monkeypatch, fails: bool) -> dict:
    import turnrl.samplers.vllm as vllm_module

    given: dict = {}

    class StandIn:
        def __init__(self, path, **kwargs):
            given["path"] = Path(path)
            assert (given["path"] / "config.json").exists()  # saved before the engine starts
            if fails:
                raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(vllm_module, "VLLMEngine", StandIn)
    return given


def _worker_engine(tmp_path):
    from turnrl.config import load_config
    from turnrl.distributed.workers import worker_sampler

    cfg = load_config(None, TINY + ["--run.mode", "async", "--rollout.sampler", "vllm",
                                    "--ray.worker_gpus", "1", "--run.out_dir", str(tmp_path)])
    return worker_sampler(cfg, 0, None)[2]


def _sync_engine(tmp_path):
    from turnrl.config import load_config
    from turnrl.models import tiny_model
    from turnrl.policy import sampler

    cfg = load_config(None, TINY + ["--rollout.sampler", "vllm", "--run.out_dir", str(tmp_path)])
    model, tokenizer = tiny_model(seed=0)
    return sampler(cfg, model, tokenizer)


@pytest.mark.parametrize("make", [_worker_engine, _sync_engine])
def test_an_engine_that_starts_owns_its_directory_and_one_that_fails_leaves_none(
        monkeypatch, tmp_path, make):
    given = _standin(monkeypatch, fails=False)
    engine = make(tmp_path)
    assert given["path"].name.startswith(PREFIX) and given["path"].exists()
    engine.model_dir_cleanup()  # a worker's stop; else the engine's collection or the exit
    assert not given["path"].exists()
    given = _standin(monkeypatch, fails=True)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        make(tmp_path)
    assert not given["path"].exists()
