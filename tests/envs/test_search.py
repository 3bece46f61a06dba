"""The ``search`` env: a generated world, held-out questions, its searching reference player
solving every question through the turn loop, and the tiny model training on it."""

from __future__ import annotations

import asyncio
import json

import pytest

from turnrl.cli import main
from turnrl.config import load_config
from turnrl.demos.scripted import env_demonstrations, reference_episode
from turnrl.envs import ENVS, make_env
from turnrl.envs.search import (
    Searcher,
    all_questions,
    answer_match,
    build_corpus,
    build_world,
    parse_question,
)
from turnrl.metrics import read_metrics
from turnrl.rollout import ChatFormat
from turnrl.trainer import train


def test_the_world_is_deterministic_and_its_questions_have_checkable_answers():
    kinds, facts = build_world(0, 80)
    assert build_world.__wrapped__(0, 80) == (kinds, facts)
    assert build_world.__wrapped__(1, 80)[0] != kinds  # another seed, another world
    assert len(set(kinds)) == len(kinds) and {"country", "city", "person"} <= set(kinds.values())
    for task in all_questions(0, 80, 2)[:30]:  # the answer is two facts away
        entity, (first, second) = parse_question(task.prompt)
        assert facts[(facts[(entity, first)], second)] == task.answer
    docs = build_corpus(0, 80).documents.values()
    assert len(docs) == len(kinds) and all(d.text.startswith(f"{d.title} is a") for d in docs)


@pytest.mark.parametrize("hops", [1, 2])
def test_held_out_questions_never_appear_in_training(hops):
    train_env, eval_env = make_env("search", hops=hops), make_env("search", hops=hops,
                                                                   split="eval")
    train_prompts = {t.prompt for t in train_env.questions}
    eval_prompts = {t.prompt for t in eval_env.questions}
    assert train_prompts.isdisjoint(eval_prompts) and len(eval_prompts) >= 10
    assert train_env.eval_options == {"split": "eval"}
    drawn = {asyncio.run(eval_env.reset(seed)) for seed in range(200)}
    assert drawn == eval_prompts  # eval seeds walk the eval questions, nothing else
    first_epoch = [train_env.task_for(s).prompt for s in range(len(train_prompts))]
    assert set(first_epoch) == train_prompts  # one epoch: each training question once


def test_the_reward_is_exact_match_of_the_final_answer():
    assert answer_match("Answer: Avo", "Avo") == 1.0
    assert answer_match("The answer is \\boxed{avo}.", "Avo") == 1.0
    assert answer_match("Avo.", "Avo") == 1.0 and answer_match("Answer: Avon", "Avo") == 0.0
    assert answer_match("I think it is Avo", "Avo") == 0.0


@pytest.mark.parametrize("hops", [1, 2])
def test_the_reference_player_solves_every_question_through_the_turn_loop(tiny, hops):
    _, tokenizer = tiny
    chat = ChatFormat(tokenizer)
    env = make_env("search", hops=hops, split="eval")
    for split, count in (("eval", len(env.questions)), ("train", 40)):
        for seed in range(count):
            episode = reference_episode(lambda s=split: make_env("search", hops=hops, split=s),
                                        "search", seed, chat, max_turns=10, env_timeout_s=10)
            assert episode.success, (split, seed, episode.end_reason)
            assert len(episode.turns) == hops + 1 and episode.info["tool_calls"] == hops


def test_the_player_opens_the_document_when_no_snippet_states_the_fact():
    player = Searcher()
    player.reset("What is the river of Quen?")
    assert '"query": "river of Quen"' in player.act("What is the river of Quen?")
    hits = {"name": "search", "content": "doc-4 | Avo | Avo is a river.\ndoc-2 | Quen | Quen "
                                         "is a city."}
    opened = player.act(f"<tool_response>\n{json.dumps(hits)}\n</tool_response>")
    assert '"name": "open"' in opened and '"doc_id": "doc-2"' in opened
    page = {"name": "open", "content": "Quen\nQuen is a city. The river of Quen is Avo."}
    assert player.act(f"<tool_response>\n{json.dumps(page)}\n</tool_response>") == "Answer: Avo"


def test_demonstrations_render_for_sft(tiny):
    _, tokenizer = tiny
    demos, failed = env_demonstrations("search", {"hops": 2}, 3, ChatFormat(tokenizer),
                                       max_turns=6)
    assert len(demos) == 3 and failed == []
    replies = [turn.action for turn in demos[0].episodes[0].turns]
    assert '"name": "search"' in replies[0] and replies[-1].startswith("Answer: ")


@pytest.mark.parametrize("options, message", [
    ({"hops": 4}, "hops must be 1, 2 or 3"),
    ({"docs": 5}, "docs must be >= 20"),
    ({"split": "test"}, "use train or eval"),
    ({"eval_fraction": 1.5}, "eval_fraction must be in"),
])
def test_bad_options_fail_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        make_env("search", **options)


def test_turnrl_envs_lists_and_describes_it(capsys):
    assert "search" in ENVS
    assert main(["envs", "search"]) == 0
    out = capsys.readouterr().out
    assert "tool search:" in out and "tool open:" in out and "hops = 2" in out


def test_the_tiny_model_plays_and_trains_on_it(tmp_path):
    """The tiny model's own episodes through the loop (its 1024-character context cannot hold a
    whole demonstration, so guidance is left off here; SmolLM2's BPE fits several)."""
    cfg = load_config(None, ["--model.name", "tiny", "--env.name", "search",
                             "--env.options.hops", "1", "--env.options.top_k", "1",
                             "--rollout.max_new_tokens", "48", "--rollout.group_size", "2",
                             "--rollout.groups_per_step", "2", "--run.steps", "2",
                             "--eval.episodes", "0", "--run.progress", "false",
                             "--run.tensorboard", "false", "--run.out_dir", str(tmp_path)])
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["episode/turns"] >= 1 and r["episode/failed"] == 0 for r in records)
