"""``turnrl train | sft | rm | eval | serve | tinker | report | envs | samplers``; the options are generated from the config."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from turnrl.config import ConfigError, config_help, load_config, load_run_config
from turnrl.learner.world import RankLost

USAGE = """turnrl train  [--config FILE.yaml] [--resume] [--mode sync|async] [--section.key VALUE ...]
turnrl sft    --sft.data FILE.jsonl [--model.name M] [--run.out_dir DIR] [--resume] [--section.key VALUE ...]
turnrl rm     --data PAIRS.jsonl [--model.name M] [--run.out_dir DIR] [--resume] [--section.key VALUE ...]
turnrl eval   [--config FILE.yaml] [--checkpoint DIR] [--samples N] [--out FILE.json] [--section.key VALUE ...]
turnrl eval   --compare A B [--samples N] [--out FILE.json] ...    (A, B: checkpoint, run dir or base)
turnrl eval   RUN_DIR [RUN_DIR ...] [--samples N] [--out FILE.json] ...  (seeds of one config)
turnrl serve  [--config FILE.yaml] [--model.name M] [--serve.host H] [--serve.port P]
              [--serve.api_key KEY] [--serve.checkpoint DIR] [--section.key VALUE ...]
turnrl tinker [--model.name M] [--serve.host H] [--serve.port P] [--serve.api_key KEY]
              [--run.out_dir DIR] [--run.threads N]  (a Tinker-compatible service, docs/tinker.md)
turnrl report RUN_DIR [RUN_DIR ...] [--out FILE.png] [--html FILE.html]
turnrl envs   [NAME] [--env.module M]                (every env, or one in full)
turnrl samplers                                      (every sampler; which this machine runs)
turnrl export CHECKPOINT_DIR|RUN_DIR OUT_DIR [--adapter-only]   (a Hugging Face model dir)

Every config field is an option: --section.key VALUE."""


def _split(argv: Sequence[str], flags: dict[str, bool]) -> tuple[dict, list[str]]:
    """Take our own flags (name -> takes a value) out of argv; the rest are config overrides."""
    found, rest, args = {}, [], list(argv)
    while args:
        arg = args.pop(0)
        name = arg.split("=", 1)[0]
        if name in flags:
            if flags[name]:
                if "=" in arg:
                    found[name] = arg.split("=", 1)[1]
                elif args:
                    found[name] = args.pop(0)
                else:
                    raise ConfigError(f"{name} needs a value")
            else:
                found[name] = True
        else:
            rest.append(arg)
    return found, rest


def cmd_train(argv: Sequence[str]) -> int:
    # The run's modules (transformers, torch.distributed, ...; ~3 s) only once the config is
    # read: a mistyped option is answered in ~2 s, not ~6 s. So for sft, rm and serve.
    own, overrides = _split(argv, {"--config": True, "--resume": False, "--mode": True})
    if "--mode" in own:  # shorthand for --run.mode
        overrides += ["--run.mode", own["--mode"]]
    cfg = load_config(own.get("--config"), overrides)
    if own.get("--resume") and cfg.run.out_dir:
        if "--config" in own:
            raise ConfigError("--resume continues a run with its saved config; drop --config")
        saved = Path(cfg.run.out_dir) / "config.yaml"
        if saved.exists():  # overrides apply on top of the saved config, and are checked
            cfg = load_run_config(str(saved), overrides)
    from turnrl.launch import train

    train(cfg, resume=bool(own.get("--resume")))
    return 0


def cmd_sft(argv: Sequence[str]) -> int:
    """``turnrl sft --sft.data FILE.jsonl``: supervised fine-tuning (docs/sft.md)."""
    own, overrides = _split(argv, {"--config": True, "--resume": False})
    cfg = _run_config(own, overrides)
    from turnrl.sft.train import sft

    sft(cfg, resume=bool(own.get("--resume")))
    return 0


def _run_config(own: dict, overrides: list[str]):
    """The config of a run to start, or (``--resume``) the run's saved config with the
    overrides on top (``prepare_run_dir`` refuses those a resume may not change)."""
    cfg = load_config(own.get("--config"), overrides)
    if own.get("--resume") and cfg.run.out_dir:
        if "--config" in own:
            raise ConfigError("--resume continues a run with its saved config; drop --config")
        saved = Path(cfg.run.out_dir) / "config.yaml"
        if saved.exists():
            cfg = load_config(str(saved), overrides)
    return cfg


def cmd_rm(argv: Sequence[str]) -> int:
    """``turnrl rm --data pairs.jsonl``: a reward model on preference pairs
    (docs/reward_models.md)."""
    own, overrides = _split(argv, {"--config": True, "--resume": False, "--data": True})
    if "--data" in own:  # shorthand for --reward.data
        overrides += ["--reward.data", own["--data"]]
    cfg = _run_config(own, overrides)
    from turnrl.sft.reward_model import train_reward_model

    train_reward_model(cfg, resume=bool(own.get("--resume")))
    return 0


def cmd_eval(argv: Sequence[str]) -> int:
    from turnrl import safe_json
    from turnrl.checkpoint_eval import eval_compare, eval_one, eval_seeds

    args = list(argv)
    run_dirs = []
    while args and not args[0].startswith("-"):  # leading RUN_DIRs: seeds of one config
        run_dirs.append(args.pop(0))
    pair = None
    if "--compare" in args:
        i = args.index("--compare")
        pair = args[i + 1:i + 3]
        if len(pair) != 2 or any(p.startswith("--") for p in pair):
            raise ConfigError("--compare needs two checkpoints: --compare A B "
                              "(each a checkpoint dir, a run dir or 'base')")
        del args[i:i + 3]
    own, overrides = _split(args, {"--config": True, "--checkpoint": True, "--samples": True,
                                   "--out": True})
    samples = own.get("--samples", "1")
    if not samples.isdigit() or int(samples) < 1:
        raise ConfigError(f"--samples must be a whole number >= 1, got '{samples}'")
    if sum(bool(x) for x in (run_dirs, pair, "--checkpoint" in own)) > 1:
        raise ConfigError("give one of: RUN_DIR [RUN_DIR ...], --compare A B, --checkpoint DIR")
    config = own.get("--config")
    if pair:
        report = eval_compare(*pair, config, overrides, int(samples))
    elif len(run_dirs) > 1:
        report = eval_seeds(run_dirs, config, overrides, int(samples))
    elif run_dirs:  # one run: its newest checkpoint
        report = eval_one(run_dirs[0], config, overrides, int(samples))
    else:
        report = eval_one(own.get("--checkpoint"), config, overrides, int(samples))
    if "--out" in own:
        out = Path(own["--out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(safe_json.dumps(report, indent=1))
        print(f"wrote {out}")
    return 0


def cmd_serve(argv: Sequence[str]) -> int:
    own, overrides = _split(argv, {"--config": True})
    cfg = load_config(own.get("--config"), overrides)
    from turnrl.serve.app import serve_forever
    from turnrl.serve.server import load_server

    serve_forever(load_server(cfg))
    return 0


def cmd_tinker(argv: Sequence[str]) -> int:
    import tempfile

    from turnrl.devices import configure_torch
    from turnrl.tinker.app import serve_forever
    from turnrl.tinker.service import Service

    own, overrides = _split(argv, {"--config": True})
    cfg = load_config(own.get("--config"), overrides)
    configure_torch(cfg.run.threads)  # before the worker thread starts: it inherits the mode
    out_dir = Path(cfg.run.out_dir or tempfile.mkdtemp(prefix="turnrl-tinker-"))
    service = Service(cfg.model.name, out_dir, cfg.model.dtype, cfg.model.cache_dir)
    serve_forever(service, cfg.serve.host, cfg.serve.port, cfg.serve.api_key)
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    from turnrl.report import write_html_report, write_report

    own, rest = _split(argv, {"--out": True, "--html": True})
    if not rest or any(r.startswith("-") for r in rest):
        raise ConfigError("usage: turnrl report RUN_DIR [RUN_DIR ...] [--out FILE.png] "
                          "[--html FILE.html]")
    if "--out" in own and len(rest) > 1:
        raise ConfigError("--out names one PNG; with several runs each gets RUN_DIR/report.png")
    for run_dir in rest:  # one PNG per run, as before
        print(write_report(run_dir, own.get("--out")))
    print(write_html_report(rest, own.get("--html")))  # every run on one page
    return 0


def cmd_envs(argv: Sequence[str]) -> int:
    """``turnrl envs``: every registered env, a line each; ``turnrl envs NAME``: one in full;
    ``--env.module M``: with the envs of a module of your own."""
    import importlib.util

    from turnrl.envs import ENVS, make_env
    from turnrl.envs.contract import describe
    from turnrl.envs.user_module import load_env_module

    own, argv = _split(argv, {"--env.module": True})
    load_env_module(own.get("--env.module", ""))

    # adapters register even when their library is missing; say what to install
    needs = {"gymnasium": "gymnasium", "reasoning-gym": "reasoning_gym", "textarena": "textarena"}

    def missing(name: str) -> bool:
        return name in needs and importlib.util.find_spec(needs[name]) is None

    if argv:
        name = argv[0]
        if name not in ENVS:
            make_env(name)  # raises the one-line error with a did-you-mean
        env, why = None, ""
        if missing(name):
            why = "needs: pip install 'turnrl[envs]'"
        else:
            try:
                env = make_env(name)
            except ValueError as err:  # required options: describe the factory only
                why = str(err)
        print(describe(name, ENVS[name], env))
        if why:
            print(f"\n(not built with default options: {why})")
        return 0
    width = max([16, *map(len, ENVS)])  # one column, however long a name
    for name, factory in ENVS.items():
        doc = (factory.__doc__ or "").strip().splitlines()
        hint = " (needs: pip install 'turnrl[envs]')" if missing(name) else ""
        print(f"{name:{width}s} {doc[0] if doc else ''}{hint}")
    print("\nturnrl envs NAME describes one: its options, prompt and tools")
    return 0


def cmd_samplers(argv: Sequence[str]) -> int:
    """``turnrl samplers``: every sampler, whether this machine runs it and what picks it."""
    from turnrl.samplers.catalog import catalog_lines

    if argv:
        print(f"turnrl samplers takes no arguments (got {' '.join(argv)})", file=sys.stderr)
        return 2
    print("\n".join(catalog_lines()))
    print("\na run prints the one it uses at start-up: the line starting 'sampler:'")
    return 0


def cmd_export(argv: Sequence[str]) -> int:
    """``turnrl export CHECKPOINT_DIR|RUN_DIR OUT_DIR``: a plain Hugging Face model directory
    (docs/models.md)."""
    from turnrl.export import export_model

    own, rest = _split(argv, {"--adapter-only": False})
    if len(rest) != 2 or any(r.startswith("-") for r in rest):
        raise ConfigError("usage: turnrl export CHECKPOINT_DIR|RUN_DIR OUT_DIR [--adapter-only]")
    result = export_model(rest[0], rest[1], adapter_only=bool(own.get("--adapter-only")))
    print(f"exported {result.checkpoint} (trained from {result.base_model}) to "
          f"{result.out_dir}; max |log-prob difference| on reload: {result.max_logprob_diff:.3g}")
    return 0


def print_help(rest: list[str]) -> int:
    """``--help``: usage and the sections; ``--help SECTION`` or ``--help all``: options."""
    i = rest.index("-h" if "-h" in rest else "--help")
    topic = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("-") else None
    try:
        text = config_help(topic)
    except ConfigError as err:
        print(f"turnrl: error: {err}", file=sys.stderr)
        return 2
    print(text if topic else f"{USAGE}\n\n{text}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "serve": cmd_serve, "report": cmd_report, "envs": cmd_envs}
COMMANDS["sft"] = cmd_sft
COMMANDS["rm"] = cmd_rm
COMMANDS["export"] = cmd_export
COMMANDS["samplers"] = cmd_samplers
COMMANDS["tinker"] = cmd_tinker


LEFTOVERS_WATCHED = ("train", "eval")
"""Commands that run envs: what those leave behind must not keep the program running."""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``turnrl`` program (``argv`` None: the command line). ``train`` and ``eval`` end
    what their envs left behind (``turnrl.leftovers``): as the program, at its end; called
    from a script (``main(["train", ...])``), at the end of the run, and the threads it left
    at the script's exit."""
    from turnrl import leftovers

    if argv is None and sys.argv[1:2] and sys.argv[1] in LEFTOVERS_WATCHED:
        before, leftovers.WATCHING = leftovers.snapshot(), True
        leftovers.end_busy_work_at_exit()
        code = _main_reporting_crashes(sys.argv[1:])
        leftovers.settle(before, code)
        return code
    if argv is not None and argv[:1] and argv[0] in LEFTOVERS_WATCHED:
        return leftovers.watched_run(lambda: _main(argv))
    return _main(argv)


def _main_reporting_crashes(argv: list[str]) -> int:
    """``_main``, a crash printed as Python would and turned into exit code 1 (130 on
    Ctrl-C), so that the leftovers are still dealt with after it."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("turnrl: interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:
        if isinstance(err.code, int) or err.code is None:
            return err.code or 0
        print(err.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - printed in full, as an uncaught one would be
        traceback.print_exc()
        return 1


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["train"]  # `turnrl` alone runs the embedded default
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command not in COMMANDS:
        print(f"turnrl: unknown command '{command}'; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        return print_help(rest)
    # Transformers' and the hub's per-load weight bars would drown our own. Said before they
    # are imported (their import costs ~1 s, which a mistyped option need not wait for); as
    # with disable_progress_bar(), a value the user set wins.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return COMMANDS[command](rest)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        # Bad input is the user's to fix: one line, no traceback.
        print(f"turnrl {command}: error: {err}", file=sys.stderr)
        return 2
    except RankLost as err:  # a learner rank died or hung: which, and how to go on
        print(f"turnrl {command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
