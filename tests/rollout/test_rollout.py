import asyncio
import time
from functools import partial

import pytest
import torch

from turnrl.algorithms.losses import token_logprobs
from turnrl.envs import StepResult, make_env
from turnrl.rollout import ChatFormat, TemplateError, run_episodes, run_sync
from turnrl.samplers import Completion, HFEngine, SamplingParams, sample_tokens
from turnrl.types import ENV_VERSION, Episode, read_episodes, write_episodes


class ScriptedEngine:
    """An Engine that replies with fixed texts (and made-up logprobs), for bookkeeping tests."""

    def __init__(self, tokenizer, replies, stop=True):
        self.tokenizer, self.replies, self.stop, self.version, self.calls = (
            tokenizer, replies, stop, 3, 0)

    def generate(self, prompts, params):
        text = self.replies[self.calls % len(self.replies)]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id] if self.stop else ids
        return [Completion(list(ids), [-0.5 - i for i in range(len(ids))],
                           "stop" if self.stop else "length") for _ in prompts]


def test_sample_tokens_greedy_and_top_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]))
    tokens, logprobs = sample_tokens(logits, 0.0, 1.0)
    assert tokens.tolist() == [0, 2]
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.6, 0.8])))
    gen = torch.Generator().manual_seed(0)
    # top_p 0.5 keeps only the top token of row 0 (0.6 >= 0.5) and of row 1.
    for _ in range(20):
        tokens, logprobs = sample_tokens(logits, 1.0, 0.5, gen)
        assert tokens.tolist() == [0, 2]
    # Logprobs are reported under the untruncated tempered policy.
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.6, 0.8])), atol=1e-6)


def test_engine_logprobs_match_a_recomputed_forward_pass(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    prompts = [tok("Say a digit.")["input_ids"], tok("Hi")["input_ids"]]  # different lengths
    params = SamplingParams(max_new_tokens=6, temperature=0.7)
    completions = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(completion.token_ids) == len(completion.logprobs) == 6
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        recomputed = token_logprobs(logits, ids[:, 1:], 0.7)[0, len(prompt) - 1:]
        assert torch.allclose(recomputed, torch.tensor(completion.logprobs), atol=1e-4)


def test_engine_stops_at_end_of_turn(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    # Make every token a stop token: each row stops after exactly one token.
    params = SamplingParams(max_new_tokens=5, stop_token_ids=tuple(range(len(tok))))
    completions = engine.generate([tok("abc")["input_ids"]] * 3, params)
    assert all(c.finish_reason == "stop" and len(c.token_ids) == 1 for c in completions)


def test_multi_turn_bookkeeping_masks_env_tokens(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    replies = ["5", "I think 8", "7"]
    engine = ScriptedEngine(tok, replies)
    make = partial(make_env, "guess-number", low=1, high=10, max_turns=3)
    episodes = asyncio.run(run_episodes(make, [(0, 0), (1, 0)], engine, chat,
                                        SamplingParams(max_new_tokens=8), env_name="guess"))
    for episode in episodes:
        assert len(episode.token_ids) == len(episode.loss_mask) == len(episode.logprobs)
        assert episode.status == "done" and 1 <= len(episode.turns) <= 3
        policy_positions = []
        for turn, reply in zip(episode.turns, replies, strict=False):
            span = episode.token_ids[turn.start:turn.end]
            assert tok.decode(span) == reply + "<|im_end|>"  # exactly what was sampled
            assert turn.action == reply
            assert episode.logprobs[turn.start:turn.end] == [-0.5 - i for i in range(len(span))]
            assert set(episode.versions[turn.start:turn.end]) == {3}
            policy_positions += range(turn.start, turn.end)
        masked = [i for i, m in enumerate(episode.loss_mask) if m]
        assert masked == policy_positions
        for i, m in enumerate(episode.loss_mask):
            if not m:
                assert episode.logprobs[i] == 0.0 and episode.versions[i] == ENV_VERSION
        # The token stream renders as the chat template renders the whole conversation.
        env = make()
        messages = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": asyncio.run(env.reset(episode.seed))}]
        for turn in episode.turns[:-1]:
            messages += [{"role": "assistant", "content": turn.action},
                         {"role": "user", "content": turn.observation}]
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        last = episode.turns[-1]
        assert tok.decode(episode.token_ids[:last.start]) == expected


def test_truncated_reply_gets_its_end_of_turn_from_the_template(tiny):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["4"], stop=False)  # hit max_new_tokens: no stop token
    make = partial(make_env, "guess-number", max_turns=2)
    [episode] = asyncio.run(run_episodes(make, [(5, 0)], engine, ChatFormat(tok),
                                         SamplingParams(max_new_tokens=1)))
    first, second = episode.turns
    between = tok.decode(episode.token_ids[first.end:second.start])
    assert between.startswith("<|im_end|>\n<|im_start|>user\n")
    assert episode.loss_mask[first.end] == 0  # the template's end-of-turn is not trained


def test_template_that_rewrites_history_is_rejected(tiny):
    _, tok = tiny
    # A template that strips whitespace from message contents changes earlier turns.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="contain surrounding whitespace"):
        ChatFormat(tok).check()


class StuckEnv:
    async def reset(self, seed):
        return "hello"

    async def step(self, action):
        await asyncio.sleep(30)
        return StepResult("", 1.0, True)


class BrokenEnv(StuckEnv):
    async def step(self, action):
        raise RuntimeError("tool crashed")


class StubbornEnv(StuckEnv):
    """Swallows cancellation and keeps going, as a careless retry loop would."""

    async def step(self, action):
        for _ in range(300):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                continue
        return StepResult("", 1.0, True)


def test_stuck_or_broken_env_fails_the_episode_not_the_run(tiny):
    _, tok = tiny
    engine = ScriptedEngine(tok, ["ok"])
    for env_cls, status, reason in [(StuckEnv, "timeout", "timed out"),
                                    (StubbornEnv, "timeout", "timed out"),
                                    (BrokenEnv, "error", "tool crashed")]:
        started = time.monotonic()
        [episode] = run_sync(run_episodes(env_cls, [(0, 0)], engine, ChatFormat(tok),
                                          SamplingParams(), env_timeout_s=2.0))
        assert time.monotonic() - started < 15  # the stubborn env's 30 s were not waited for
        assert episode.status == status and reason in episode.info["reason"]
        assert episode.reward == 0.0 and not episode.success


def test_episodes_round_trip_through_jsonl(tmp_path, tiny):
    _, tok = tiny
    make = partial(make_env, "guess-number", max_turns=2)
    episodes = asyncio.run(run_episodes(make, [(0, 0), (1, 1)], ScriptedEngine(tok, ["3"]),
                                        ChatFormat(tok), SamplingParams()))
    write_episodes(tmp_path / "e.jsonl", episodes)
    back = read_episodes(tmp_path / "e.jsonl")
    assert back == episodes and isinstance(back[0], Episode)


@pytest.mark.parametrize("reuse_cache, stop_chars", [(True, ""), (False, ""), (True, "aeo ")])
def test_multi_turn_logprobs_match_one_forward_over_the_episode(tiny, reuse_cache, stop_chars):
    """Token-in-token-out end to end: the stored behaviour logprobs of every turn equal a
    single forward pass over the finished episode (with and without KV reuse across turns)."""
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id, seed=1, reuse_cache=reuse_cache)
    make = partial(make_env, "guess-number", max_turns=4)
    # Stopping on common characters makes rows finish early, at different steps.
    stops = tuple(tok.convert_tokens_to_ids(list(stop_chars)))
    episodes = asyncio.run(run_episodes(make, [(s, 0) for s in range(6)], engine,
                                        ChatFormat(tok), SamplingParams(max_new_tokens=4,
                                                                        temperature=0.8,
                                                                        stop_token_ids=stops)))
    assert max(len(ep.turns) for ep in episodes) == 4  # the tiny model never wins
    if stops:
        reasons = {t.finish_reason for ep in episodes for t in ep.turns}
        assert reasons == {"stop", "length"}
    for episode in episodes:
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        recomputed = token_logprobs(logits, ids[:, 1:], 0.8)[0]
        mask = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
        stored = torch.tensor(episode.logprobs[1:])
        assert torch.allclose(recomputed[mask], stored[mask], atol=1e-4)


@pytest.mark.slow
def test_smollm2_template_and_logprobs_hold_over_turns():
    """The real offline model: its chat template passes the prefix check, and behaviour
    logprobs of a 2-turn episode match a forward pass over the whole episode."""
    from turnrl.models import load_model

    model, tok = load_model("smollm2-135m-instruct")
    chat = ChatFormat(tok)
    chat.check()
    engine = HFEngine(model, tok.pad_token_id, seed=0)
    make = partial(make_env, "guess-number", max_turns=2)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(chat.end_of_turn,))
    episodes = asyncio.run(run_episodes(make, [(0, 0), (1, 0)], engine, chat, params))
    for episode in episodes:
        assert tok.decode(episode.token_ids).startswith("<|im_start|>system\nYou are playing")
        ids = torch.tensor([episode.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        mask = torch.tensor(episode.loss_mask[1:], dtype=torch.bool)
        recomputed = token_logprobs(logits, ids[:, 1:])[0][mask]
        assert torch.allclose(recomputed, torch.tensor(episode.logprobs[1:])[mask], atol=1e-3)


# A template that drops reasoning from earlier assistant turns, as Qwen3's does.
THINK_STRIPPING = (
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_strips_reasoning_is_caught_at_start_up_and_named(tiny):
    _, tok = tiny
    tok.chat_template = THINK_STRIPPING
    with pytest.raises(TemplateError, match="earlier assistant turns that contain a reasoning "
                                            "block .*--model.chat_template"):
        ChatFormat(tok).check()


def test_a_prefix_preserving_template_file_fixes_it(tiny, tmp_path):
    from turnrl.config import load_config
    from turnrl.policy import use_chat_template

    _, tok = tiny
    kept = tok.chat_template
    tok.chat_template = THINK_STRIPPING
    template = tmp_path / "keep.jinja"
    template.write_text(kept)
    cfg = load_config(None, ["--model.chat_template", str(template)])
    use_chat_template(tok, cfg.model.chat_template)
    ChatFormat(tok).check()  # passes: earlier turns are rendered as they were
    with pytest.raises(Exception, match="model.chat_template must be an existing file"):
        load_config(None, ["--model.chat_template", str(tmp_path / "missing.jinja")])
