"""Supervised warm-up: noisy demonstrations, rollout-identical tokenisation, a saved warm start."""

import asyncio
from dataclasses import replace
from functools import partial

import pytest
import torch
from warmup import (
    MARKER,
    NOISE_KINDS,
    WarmupConfig,
    demonstrations,
    encode_demonstration,
    imitation_loss,
    warm_start,
    warm_up,
)

from turnrl.envs import make_env
from turnrl.models import load_model, tiny_model
from turnrl.rollout import ChatFormat, run_episodes
from turnrl.samplers import Completion

TASKS = [("guess-number", {"low": 1, "high": 30, "max_turns": 7}), ("maze", {"size": 3}),
         ("twenty-questions", {}), ("wordle", {})]


@pytest.mark.parametrize(("env", "options"), TASKS)
def test_clean_demonstrations_solve_and_noise_is_seeded(env, options):
    clean = demonstrations(env, options, range(20))
    assert all(success for _, success in clean)
    noisy = demonstrations(env, options, range(20), noise=0.5, seed=3)
    assert noisy == demonstrations(env, options, range(20), noise=0.5, seed=3)
    assert noisy != clean
    # the expert keeps playing after a random move: half the moves random, a third still solved
    assert sum(success for _, success in noisy) >= 7


def _wasted(env: str, transcript, i: int) -> bool:
    """Whether turn ``i`` was a no-op: what the expert never does."""
    action, actions = transcript[i][1], [a for _, a in transcript]
    if env == "maze":  # a direction not listed open where the move was made
        return action not in transcript[i][0].split("open: ")[1].split(".")[0].split(", ")
    if env == "twenty-questions":
        return action in actions[:i]
    return i > 0 and action == actions[i - 1]


@pytest.mark.parametrize(("env", "options"), TASKS)
def test_wasted_turns_leave_the_experts_game_unchanged(env, options):
    clean = demonstrations(env, options, range(30))
    noisy = demonstrations(env, options, range(30), noise=0.4, kind="wasted", seed=1)
    inserted = 0
    for (expert, _), (transcript, _) in zip(clean, noisy, strict=True):
        kept = [a for i, (_, a) in enumerate(transcript) if not _wasted(env, transcript, i)]
        inserted += len(transcript) - len(kept)
        # the expert's own moves, in order, cut short only where the turns ran out
        assert kept == [a for _, a in expert][:len(kept)]
    assert inserted > 10


def test_every_task_with_a_reference_policy_has_noise_actions():
    from turnrl.envs.reference import REFERENCE_POLICIES

    for actions in NOISE_KINDS.values():
        assert set(actions) == set(REFERENCE_POLICIES)
    with pytest.raises(ValueError, match="noise kind"):
        demonstrations("maze", {}, [0], noise=0.1, kind="typo")


class _Replay:
    """An engine that 'samples' the given actions, one per turn, then the end-of-turn token."""

    def __init__(self, chat: ChatFormat, actions: list[str]):
        self.chat, self.actions, self.version = chat, list(actions), 0

    def generate(self, prompts, params):
        assert len(prompts) == 1
        ids = self.chat.encode(self.actions.pop(0)) + [self.chat.end_of_turn]
        return [Completion(ids, [0.0] * len(ids), "stop")]


@pytest.mark.parametrize(("env", "options"), TASKS[:3])
def test_demonstration_tokens_match_the_rollout_loop(env, options):
    _, tokenizer = tiny_model()
    chat = ChatFormat(tokenizer)
    (transcript, _), = demonstrations(env, options, [5], noise=0.3, seed=1)
    ids, mask = encode_demonstration(chat, getattr(make_env(env, **options), "system_prompt",
                                                   None), transcript)
    engine = _Replay(chat, [action for _, action in transcript])
    episode, = asyncio.run(run_episodes(partial(make_env, env, **options), [(5, 0)], engine,
                                        chat, None, env_name=env, max_turns=len(transcript)))
    assert episode.token_ids == ids
    assert episode.loss_mask == mask


def test_warm_up_lowers_the_imitation_loss_and_warm_start_round_trips(tmp_path):
    wcfg = WarmupConfig("guess-number", {"low": 1, "high": 10, "max_turns": 5}, episodes=16,
                        steps=8, batch_size=2, lr=3e-3, max_positions=512)
    model, tokenizer = tiny_model(0, max_positions=512)
    losses = warm_up(model, tokenizer, wcfg)
    assert len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2])

    directory, info = warm_start(tmp_path / "warm", replace(wcfg, steps=1))
    assert (directory / MARKER).is_file() and info["config"]["steps"] == 1
    loaded, loaded_tok = load_model(str(directory))  # as --model.name DIR loads it
    assert loaded.config.max_position_embeddings == 512
    chat = ChatFormat(loaded_tok)
    chat.check()
    text = "<|im_start|>user\nGuess 1..10, é?<|im_end|>\n"
    assert loaded_tok(text, add_special_tokens=False).input_ids == tokenizer(
        text, add_special_tokens=False).input_ids
    assert loaded_tok.pad_token_id == tokenizer.pad_token_id
    assert loaded_tok.eos_token_id == tokenizer.eos_token_id
    # same weights as the warm-up saved: reload is a cache hit, not a retrain
    again, info2 = warm_start(tmp_path / "warm", replace(wcfg, steps=1))
    assert info2 == info
    ids = torch.tensor([tokenizer(text).input_ids])
    mask = torch.zeros_like(ids)
    mask[0, -5:] = 1
    reference, _ = load_model(str(again))
    with torch.no_grad():
        assert torch.equal(imitation_loss(loaded, ids, mask, torch.ones_like(ids)),
                           imitation_loss(reference, ids, mask, torch.ones_like(ids)))


def test_the_tool_task_format_warm_up_demonstrates_correct_calls_and_lowers_the_loss(tiny):
    """benchmarks/learning/tool_task.py: its demonstrations are correct episodes of a task other than
    the measured one, and imitating them lowers the loss of the call tokens."""
    import asyncio

    from tool_task import (
        called_correctly,
        format_warm_up,
        scripted_transcript,
        sum_or_difference,
    )

    from turnrl.envs.tool_env import ToolEnv, calculator, multiplication_task
    from turnrl.rewards import integer_match
    from turnrl.tools import parse_tool_calls
    from turnrl.types import Episode, Turn

    env = ToolEnv(sum_or_difference, [calculator],
                  lambda reply, answer, **_: integer_match(reply, answer, which="last"))
    transcript = asyncio.run(scripted_transcript(env, 7))
    (question, call), (response, answer) = transcript
    assert "times" not in question and ("plus" in question or "minus" in question)
    assert parse_tool_calls(call)[0].problem == "" and answer in response
    model, tokenizer = tiny
    losses = format_warm_up(model, tokenizer, demos=8, steps=8, lr=3e-3, batch=4)
    assert sum(losses[-2:]) < sum(losses[:2])
    # the measured share: a well-formed call whose result is the product asked for
    product = str(multiplication_task(3).answer)
    good = Episode("tool-arithmetic", 3, 0, info={"well_formed_calls": True},
                   turns=[Turn(0, 1, "call", f"<tool_response>\n{product}\n</tool_response>", 0)])
    wrong = Episode("tool-arithmetic", 3, 0, info={"well_formed_calls": True},
                    turns=[Turn(0, 1, "call", "<tool_response>\n12\n</tool_response>", 0)])
    assert called_correctly(good) and not called_correctly(wrong)
