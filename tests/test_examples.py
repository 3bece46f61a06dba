import asyncio
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
