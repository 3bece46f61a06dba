import dataclasses

import pytest
import yaml

from turnrl.config import (
    AlgoConfig,
    Config,
    ConfigError,
    RolloutConfig,
    config_from_dict,
    config_help,
    config_to_dict,
    field_docs,
    load_config,
    load_run_config,
    save_config,
)


def _error(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def yaml_file(tmp_path):
    def write(data) -> str:
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    return write


def test_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.env.options == {}
    assert cfg.rollout.group_size == 8
    assert cfg.algo.clip_high == 0.28
    assert cfg.eval.seed_offset == 1_000_000
    assert cfg.run.tensorboard is True and cfg.run.wandb is False


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().algo.clip_high = 1.0


def test_yaml_then_overrides(yaml_file):
    path = yaml_file({"algo": {"clip_high": 0.5, "kl_coef": 0.1}, "run": {"steps": 3}})
    cfg = load_config(path, ["--algo.clip_high", "0.3"])
    assert cfg.algo.clip_high == 0.3  # override beats file
    assert cfg.algo.kl_coef == 0.1  # file beats default
    assert cfg.run.steps == 3
    assert cfg.algo.clip_low == 0.2  # untouched default


@pytest.mark.parametrize(
    "overrides",
    [["--algo.clip_high", "0.4"], ["--algo.clip_high=0.4"], ["algo.clip_high=0.4"]],
)
def test_override_syntaxes(overrides):
    assert load_config(overrides=overrides).algo.clip_high == 0.4


def test_several_overrides_and_last_wins():
    cfg = load_config(overrides=["--run.steps", "7", "rollout.top_p=0.9", "--run.steps=9"])
    assert cfg.run.steps == 9
    assert cfg.rollout.top_p == 0.9


def test_dict_option_override(yaml_file):
    path = yaml_file({"env": {"name": "guess-number", "options": {"low": 1}}})
    cfg = load_config(path, ["--env.options.high", "20", "--env.options.name=x"])
    assert cfg.env.options == {"low": 1, "high": 20, "name": "x"}
    assert isinstance(cfg.env.options["high"], int)
    whole = load_config(overrides=["--env.options", "{high: 5}"])
    assert whole.env.options == {"high": 5}


def test_string_values_stay_strings():
    cfg = load_config(overrides=["--run.out_dir", "123", "--model.name=tiny"])
    assert cfg.run.out_dir == "123"
    assert cfg.model.name == "tiny"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("no", False)],
)
def test_bool_parsing(text, expected):
    assert load_config(overrides=[f"--run.wandb={text}"]).run.wandb is expected


def test_bad_bool():
    assert _error(["--run.wandb=maybe"]) == "run.wandb: expected bool, got 'maybe'"


def test_int_accepted_for_float(yaml_file):
    cfg = load_config(yaml_file({"algo": {"clip_high": 1}}), ["--optim.lr", "1e-4"])
    assert cfg.algo.clip_high == 1.0 and isinstance(cfg.algo.clip_high, float)
    assert cfg.optim.lr == pytest.approx(1e-4)


def test_float_rejected_for_int(yaml_file):
    assert _error(path=yaml_file({"run": {"steps": 1.5}})) == "run.steps: expected int, got 1.5"


def test_unknown_key_suggests_closest():
    message = _error(["--algo.clip_hihg", "0.3"])
    assert message == "unknown config key 'algo.clip_hihg'; did you mean 'algo.clip_high'?"


def test_unknown_section_suggests_closest(yaml_file):
    assert "did you mean 'algo.clip_high'?" in _error(["--alg.clip_high=1"])
    message = _error(path=yaml_file({"algoo": {"clip_high": 1}}))
    assert message == "unknown config section 'algoo'; did you mean 'algo'?"


def test_key_in_wrong_section_suggests_right_one():
    assert _error(["--rollout.lr=1"]).endswith("did you mean 'optim.lr'?")


def test_unknown_key_without_match_lists_section():
    message = _error(["--algo.zzz=1"])
    assert message.startswith("unknown config key 'algo.zzz'; valid keys in 'algo': advantage,")
    assert "clip_high" in message


def test_wrong_type():
    assert _error(["--algo.clip_high", "abc"]) == "algo.clip_high: expected float, got 'abc'"


def test_bad_literal():
    message = _error(["--algo.loss_agg", "token_meen"])
    assert message.startswith("algo.loss_agg: 'token_meen' is not one of token_mean")
    assert message.endswith("did you mean 'token_mean'?")


def test_unknown_estimator_is_checked_against_the_registry():
    message = _error(["--algo.advantage", "grpoo"])
    assert message == "algo.advantage: unknown advantage estimator 'grpoo'; did you mean 'grpo'?"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.group_size=0", "rollout.group_size must be >= 1, got 0"),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1], got 0.0"),
        ("rollout.temperature=-1", "rollout.temperature must be >= 0, got -1.0"),
        ("algo.clip_low=-0.1", "algo.clip_low must be >= 0, got -0.1"),
        ("algo.epochs=0", "algo.epochs must be >= 1, got 0"),
        ("optim.lr=0", "optim.lr must be > 0, got 0.0"),
        ("optim.micro_batch_size=0", "optim.micro_batch_size must be >= 1, got 0"),
        ("run.steps=0", "run.steps must be >= 1, got 0"),
        ("sampler.gpu_memory_utilization=0",
         "sampler.gpu_memory_utilization must be in (0, 1], got 0.0"),
    ],
)
def test_range_checks(override, message):
    assert _error([override]) == message


def test_range_checks_on_direct_construction():
    with pytest.raises(ConfigError, match="rollout.group_size must be >= 1"):
        RolloutConfig(group_size=0)
    assert AlgoConfig(clip_high=1).clip_high == 1.0  # construction converts types too


def test_missing_file():
    assert _error(path="nope.yaml") == "config file 'nope.yaml' not found; check the path"


def test_yaml_top_level_not_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert "must be a mapping of sections" in _error(path=str(path))


def test_section_not_mapping(yaml_file):
    assert "config section 'algo' must be a mapping" in _error(path=yaml_file({"algo": 3}))


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(str(path)) == Config()


@pytest.mark.parametrize("overrides", [["--algo.clip_high"], ["--algo.clip_high", "--run.seed=1"]])
def test_override_without_value(overrides):
    assert _error(overrides) == "--algo.clip_high needs a value"


def test_round_trip(tmp_path):
    cfg = load_config(
        overrides=["--algo.advantage=rloo", "--env.options.high=20", "--run.wandb=yes"]
    )
    data = config_to_dict(cfg)
    assert data["algo"]["advantage"] == "rloo" and data["env"]["options"] == {"high": 20}
    assert config_from_dict(data) == cfg
    path = tmp_path / "sub" / "config.yaml"
    save_config(cfg, path)
    assert load_config(str(path)) == cfg
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg


def test_config_from_dict_validates():
    with pytest.raises(ConfigError, match="did you mean 'algo.clip_high'"):
        config_from_dict({"algo": {"clip_hihg": 0.3}})
    with pytest.raises(ConfigError, match="must be >= 1"):
        config_from_dict({"rollout": {"group_size": 0}})


def test_dict_option_not_shared_between_configs():
    first = load_config(overrides=["--env.options.high=20"])
    assert load_config().env.options == {}
    assert first.env.options == {"high": 20}


def test_every_field_has_a_docstring():
    classes = [Config] + [type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)]
    for cls in classes:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_help_lists_the_sections_one_line_each():
    lines = config_help().splitlines()[1:]
    fields = dataclasses.fields(Config)
    assert [line.split()[0] for line in lines] == [f.name for f in fields]
    for line, f in zip(lines, fields, strict=True):
        count = len(dataclasses.fields(type(getattr(Config(), f.name))))
        assert line.endswith(f"({count} options)")
    assert "turn-level" in next(line for line in lines if line.split()[0] == "critic")


def test_help_of_a_section_lists_its_options_with_type_default_and_doc():
    text = config_help("algo")
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert flags == [f"--algo.{f.name}" for f in dataclasses.fields(AlgoConfig)]
    assert "  --algo.clip_high FLOAT (default 0.28)" in text.splitlines()
    assert "DAPO" in text and "--critic." not in text
    assert "  --pool.auto BOOL (default True)" in config_help("pool").splitlines()
    every = config_help("all")
    assert sum(line.startswith("  --") for line in every.splitlines()) == sum(
        len(dataclasses.fields(type(getattr(Config(), f.name))))
        for f in dataclasses.fields(Config))
    with pytest.raises(ConfigError, match="did you mean 'critic'"):
        config_help("critc")


def test_cli_help_prints_sections_and_a_section(capsys):
    from turnrl.cli import main

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "turnrl train" in out and "  pool " in out and "--critic.gamma" not in out
    assert main(["train", "--help", "critic"]) == 0
    out = capsys.readouterr().out
    assert "--critic.gamma FLOAT (default 0.95)" in out and "turnrl eval" not in out
    assert main(["train", "--help", "nope"]) == 2
    assert "no such config section" in capsys.readouterr().err


MOVED_KEYS = [("algo.gamma", "0.9", "critic.gamma"), ("algo.critic_lr", "0.01", "critic.lr"),
              ("algo.critic_updates", "3", "critic.updates"),
              ("algo.replay_episodes", "4", "critic.replay_episodes"),
              ("credit.scale", "none", "critic.scale"),
              ("credit.critic_features", "frozen", "critic.features"),
              ("credit.gigpo_episode_weight", "0", "critic.gigpo_episode_weight"),
              ("staleness.overprovision", "2", "pool.overprovision"),
              ("staleness.auto", "false", "pool.auto"),
              ("staleness.pool_memory_fraction", "0.5", "pool.memory_fraction"),
              ("serve.train_mode", "async", "run.mode"),
              ("rollout.engine", "auto", "rollout.sampler"),
              ("rollout.engine_dtype", "float32", "rollout.sampler_dtype"),
              ("rollout.matmul", "torch", "sampler.matmul"),
              ("rollout.reuse_cache", "false", "sampler.reuse_cache"),
              ("ray.gpu_memory_utilization", "0.3", "sampler.gpu_memory_utilization"),
              ("staleness.keep_kv_cache", "false", "sampler.keep_kv_cache")]


@pytest.mark.parametrize(("old", "value", "new"), MOVED_KEYS)
def test_an_old_key_fails_with_one_line_naming_the_new_one(yaml_file, old, value, new):
    message = _error([f"--{old}", value])
    assert message.startswith(f"config key '{old}' moved to '{new}'")
    section, name = old.split(".")
    assert _error(path=yaml_file({section: {name: value}})) == message


@pytest.mark.parametrize(("old", "value", "new"), MOVED_KEYS)
def test_a_stored_config_with_old_keys_still_loads_at_the_new_place(tmp_path, old, value, new):
    stored = config_to_dict(load_config(overrides=["--algo.advantage", "archer"]))
    del stored["critic"], stored["pool"], stored["sampler"]  # written before they existed
    del stored["rollout"]["sampler"], stored["rollout"]["sampler_dtype"]
    section, name = old.split(".")
    stored.setdefault(section, {})[name] = yaml.safe_load(value)
    if new.startswith("critic.gigpo"):
        stored["algo"]["advantage"] = "gigpo"
    if new == "critic.replay_episodes":
        stored["algo"]["advantage"] = "archer"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(stored))
    new_section, new_name = new.split(".")
    for cfg in (config_from_dict(yaml.safe_load(path.read_text())), load_run_config(str(path))):
        got = getattr(getattr(cfg, new_section), new_name)
        assert got == type(got)(yaml.safe_load(value)) if not isinstance(got, str) \
            else got == value
    with pytest.raises(ConfigError, match="moved to"):  # overrides on top are still checked
        load_run_config(str(path), [f"--{old}", value])


@pytest.mark.parametrize(("old", "value"), [("ray.engine", "vllm"), ("ray.engine_dtype", "int8")])
def test_the_async_workers_old_sampler_keys_name_the_one_key(old, value):
    new = "rollout.sampler" + ("_dtype" if old.endswith("dtype") else "")
    assert _error([f"--{old}", value]).startswith(f"config key '{old}' moved to '{new}'")


@pytest.mark.parametrize(("mode", "expected"), [("async", ("vllm", "float16")),
                                                ("sync", ("hf", "auto"))])
def test_a_stored_run_keeps_the_sampler_its_mode_read(tmp_path, mode, expected):
    """An async run's workers sampled with ray.engine; a sync run never read it."""
    stored = config_to_dict(load_config(overrides=["--ray.worker_gpus", "1"]))
    del stored["sampler"]
    stored["run"]["mode"] = mode
    stored["rollout"] |= {"engine": "hf", "engine_dtype": "auto"}
    del stored["rollout"]["sampler"], stored["rollout"]["sampler_dtype"]
    stored["ray"] |= {"engine": "vllm", "engine_dtype": "float16"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(stored))
    cfg = load_run_config(str(path))
    assert (cfg.rollout.sampler, cfg.rollout.sampler_dtype) == expected


def test_pool_options_have_their_own_section():
    cfg = load_config(overrides=["--pool.overprovision", "2", "--pool.queued_groups", "3",
                                 "--pool.auto", "false", "--pool.memory_fraction", "0.5"])
    assert (cfg.pool.overprovision, cfg.pool.queued_groups, cfg.pool.auto,
            cfg.pool.memory_fraction) == (2.0, 3, False, 0.5)
    assert cfg.sampler.keep_kv_cache  # how stale a continued episode is: staleness
    assert _error(["--pool.memory_fraction", "0"]) == \
        "pool.memory_fraction must be in (0, 1], got 0.0"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--rollout.sampler", "vllm", "--ray.worker_gpus", "1", "--rollout.temperature", "0.005"],
         "rollout.temperature 0.005 with rollout.sampler vllm"),
        (["--critic.scale", "none"], "critic.scale is not read by algo.advantage grpo"),
        (["--algo.advantage", "gigpo", "--critic.lr", "0.1"],
         "critic.lr is not read by algo.advantage gigpo (read by: turn_gae, token_gae, archer)"),
        (["--run.mode", "async", "--explore.temperature_schedule", "linear", "--rollout.sampler",
          "ct2"], "explore.temperature_schedule with rollout.sampler ct2 in run.mode async"),
        (["--rollout.sampler", "vllm", "--ray.worker_gpus", "1", "--explore.temperature_schedule",
          "cosine", "--explore.temperature_end", "3"],
         "explore.temperature_end 3.0 with rollout.sampler vllm"),
        (["--explore.pass_k", "9"], "exceeds rollout.group_size"),
        (["--run.mode", "async", "--rollout.sampler", "auto"],
         "async rollout workers need one named: --rollout.sampler hf, ct2 or vllm"),
        (["--run.mode", "async", "--rollout.sampler", "vllm"],
         "rollout.sampler vllm on async workers samples on a GPU: reserve one per worker with "
         "--ray.worker_gpus 1"),
        (["--rollout.sampler_dtype", "int8"], "use it with --rollout.sampler ct2"),
        (["--explore.pass_k", "2", "--algo.advantage", "archer"], "archer is turn-level"),
    ],
)
def test_cross_section_checks_run_when_the_config_is_built(overrides, message):
    error = _error(overrides)
    assert message in error



FAST_FAIL = """
import sys
from turnrl.cli import main
codes = [main([command, "--nope", "1"]) for command in ("train", "sft", "rm", "serve")]
print(codes, sorted(m for m in ("transformers", "turnrl.launch", "turnrl.serve.server",
                                "turnrl.sft.train", "turnrl.sft.reward_model") if m in sys.modules))
"""


def test_a_mistyped_option_is_answered_before_the_run_s_modules_load():
    """A fresh process: the error comes from the config alone; transformers and the run's
    own modules (about 3 s of imports) are never loaded for it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAST_FAIL], capture_output=True, text=True,
                          timeout=300)
    for command in ("train", "sft", "rm", "serve"):
        assert f"turnrl {command}: error: unknown config key 'nope'" in done.stderr, done.stderr
    assert done.stdout.split() == ["[2,", "2,", "2,", "2]", "[]"], done.stdout + done.stderr
