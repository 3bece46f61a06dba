import asyncio
import json
import runpy
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_calculator_env_rewards_the_tool_path():
    env_cls = runpy.run_path(str(EXAMPLES / "calculator_env.py"))["Calculator"]

    async def play(replies):
        env = env_cls()
        await env.reset(0)
        for reply in replies:
            result = await env.step(reply)
            if result.done:
                return result
        return result

    env = env_cls()
    asyncio.run(env.reset(0))
    product = env.a * env.b
    tool = asyncio.run(env.step(f"CALC: {env.a}*{env.b}"))
    assert tool.observation == str(product) and not tool.done
    assert asyncio.run(play([f"CALC: {env.a}*{env.b}", f"ANSWER: {product}"])).reward == 1.0
    assert asyncio.run(play(["ANSWER: 1"])).reward == 0.0
    assert asyncio.run(play(["hmm", "hmm", "hmm"])).done


def test_calculator_example_trains_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLES / "calculator_env.py"), "--run.out_dir",
                          str(tmp_path), "--run.progress", "false"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "before" in out.stdout and "after 3 steps" in out.stdout
    assert (tmp_path / "checkpoints" / "step-000003").is_dir()


def guided_run(example: str, out: Path, *extra: str) -> list[dict]:
    """One guided step of an example as the README documents it (tiny model: it never
    succeeds on its own, so every group is all-failed and guided)."""
    done = subprocess.run([sys.executable, str(EXAMPLES / example), "--run.out_dir", str(out),
                           "--run.steps", "1", "--eval.episodes", "0", "--run.progress", "false",
                           "--explore.guidance", "demo", *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot be guided" not in done.stderr  # the expert's replies fit the token budget
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_calculator_example_expert_guides_failed_groups(tmp_path):
    """The README's SmolLM2 command adds ``--explore.guidance demo``: the example's expert
    must solve each failed group's seed through the real turn loop."""
    (step,) = guided_run("calculator_env.py", tmp_path)
    assert step["guide/fired_groups"] >= 1 and step["guide/episodes"] >= 1
    assert step["guide/success"] == 1.0


def test_tool_task_example_expert_solves_every_seed():
    """The date-span task names its tool call (``Task.calls``), so ToolEnv's built-in expert
    (what ``--explore.guidance demo`` plays; the tiny model's context is too short for the
    tool schema, so this plays the env directly) calls the tool, reads it and answers right."""
    make = runpy.run_path(str(EXAMPLES / "tool_task.py"))["date_span"]

    async def play(seed):
        env = make()
        first = await env.reset(seed)
        player = env.reference_player()
        player.reset(first)
        observation = first
        for _ in range(env.max_turns):
            result = await env.step(player.act(observation))
            observation = result.observation
            if result.done:
                return result
        return result

    for seed in range(6):
        result = asyncio.run(play(seed))
        assert result.done and result.info["success"], (seed, result)
        assert result.info["tool_calls"] == 1 and result.info["malformed_calls"] == 0


def test_the_recipe_trains_the_same_weights_as_turnrl_train(tmp_path):
    """examples/recipe.py writes the loop out; it must stay the loop `turnrl train` runs."""
    args = ["--model.name", "tiny", "--run.steps", "2", "--run.threads", "1", "--eval.episodes",
            "4", "--run.progress", "false"]
    for name, command in (("recipe", [str(EXAMPLES / "recipe.py")]),
                          ("train", ["-m", "turnrl.cli", "train"])):
        done = subprocess.run([sys.executable, *command, *args, "--run.out_dir",
                               str(tmp_path / name)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "after 2 steps" in done.stdout
    weights = [(tmp_path / name / "checkpoints" / "step-000002" / "model.safetensors").read_bytes()
               for name in ("recipe", "train")]
    assert weights[0] == weights[1]
    assert len((EXAMPLES / "recipe.py").read_text().splitlines()) <= 60
