"""``turnrl train | eval | serve | report | envs``; the options are generated from the config."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from turnrl.config import ConfigError, config_help, load_config

USAGE = """turnrl train  [--config FILE.yaml] [--resume] [--mode sync|async] [--section.key VALUE ...]
turnrl eval   [--config FILE.yaml] [--checkpoint DIR] [--section.key VALUE ...]
turnrl serve  [--config FILE.yaml] [--model.name M] [--serve.host H] [--serve.port P]
              [--serve.api_key KEY] [--serve.checkpoint DIR] [--section.key VALUE ...]
turnrl report RUN_DIR [--out FILE.png]
turnrl envs

Every config field is an option; `turnrl train --help` lists them with their docs."""


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
    from turnrl.launch import train

    own, overrides = _split(argv, {"--config": True, "--resume": False, "--mode": True})
    if "--mode" in own:  # shorthand for --run.mode
        overrides += ["--run.mode", own["--mode"]]
    cfg = load_config(own.get("--config"), overrides)
    if own.get("--resume") and cfg.run.out_dir:
        if "--config" in own:
            raise ConfigError("--resume continues a run with its saved config; drop --config")
        saved = Path(cfg.run.out_dir) / "config.yaml"
        if saved.exists():  # overrides apply on top of the saved config, and are checked
            cfg = load_config(str(saved), overrides)
    train(cfg, resume=bool(own.get("--resume")))
    return 0


def cmd_eval(argv: Sequence[str]) -> int:
    import torch

    from turnrl.checkpoint import load_checkpoint
    from turnrl.evaluation import COLUMNS
    from turnrl.metrics import print_table
    from turnrl.models import configure_torch
    from turnrl.policy import load_policy

    own, overrides = _split(argv, {"--config": True, "--checkpoint": True})
    config_path = own.get("--config")
    run_config = Path(own.get("--checkpoint", ".")).parent.parent / "config.yaml"
    if config_path is None and "--checkpoint" in own and run_config.exists():
        config_path = str(run_config)  # evaluate on the run's own model, env and settings
    cfg = load_config(config_path, overrides)
    configure_torch(cfg.run.threads)
    policy = load_policy(cfg)
    label = cfg.model.name
    if "--checkpoint" in own:
        checkpoint = Path(own["--checkpoint"])
        if not (checkpoint / "model.safetensors").is_file():
            raise FileNotFoundError(f"no checkpoint at '{checkpoint}'; pass a "
                                    "RUN_DIR/checkpoints/step-NNNNNN directory")
        load_checkpoint(checkpoint, policy.model, torch.optim.AdamW(policy.model.parameters()))
        label = checkpoint.name
    result, _ = policy.run_eval()
    print_table(f"{cfg.env.name}: {cfg.model.name}", COLUMNS, [result.row(label)])
    return 0


def cmd_serve(argv: Sequence[str]) -> int:
    from turnrl.serve.app import serve_forever
    from turnrl.serve.server import load_server

    own, overrides = _split(argv, {"--config": True})
    serve_forever(load_server(load_config(own.get("--config"), overrides)))
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    from turnrl.report import write_report

    own, rest = _split(argv, {"--out": True})
    if len(rest) != 1:
        raise ConfigError("usage: turnrl report RUN_DIR [--out FILE.png]")
    print(write_report(rest[0], own.get("--out")))
    return 0


def cmd_envs(argv: Sequence[str]) -> int:
    import importlib.util

    from turnrl.envs import ENVS

    # adapters register even when their library is missing; say what to install
    needs = {"gymnasium": "gymnasium", "reasoning-gym": "reasoning_gym", "textarena": "textarena"}
    for name, factory in ENVS.items():
        doc = (factory.__doc__ or "").strip().splitlines()
        missing = name in needs and importlib.util.find_spec(needs[name]) is None
        hint = " (needs: pip install 'turnrl[envs]')" if missing else ""
        print(f"{name:16s} {doc[0] if doc else ''}{hint}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "serve": cmd_serve, "report": cmd_report, "envs": cmd_envs}


def main(argv: Sequence[str] | None = None) -> int:
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
        print(USAGE + "\n\nConfig options:\n" + config_help())
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-load weight bars would drown our own
    try:
        return COMMANDS[command](rest)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        # Bad input is the user's to fix: one line, no traceback.
        print(f"turnrl {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
