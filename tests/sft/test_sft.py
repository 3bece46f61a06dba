"""Supervised fine-tuning: conversations tokenised exactly as the turn loop tokenises a played
episode, refusals with reasons, the JSONL reader's one-line errors, training, resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.rollout.test_rollout import ScriptedEngine
from tests.rollout.test_tool_loop import NATIVE, _env, _hermes
from turnrl.demos.conversation import DemoError, conversation_episode, episode_conversation
from turnrl.envs import StepResult, make_env, register_env
from turnrl.envs.tool_env import calculator
from turnrl.models import tiny_model, tiny_tokenizer
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import Completion, SamplingParams

# NATIVE (a Qwen-like template) that also renders OpenAI-style ``tool_calls`` itself, as
# Qwen's and Hermes' templates do: one <tool_call> block per call after the content.
WITH_TOOL_CALLS = NATIVE.replace(
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>",
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>")


class RestrictedEngine:
    """The tiny model sampling for real, restricted to printable ASCII and its end of turn (a
    random model otherwise writes stray UTF-8 bytes no text re-encodes to)."""

    def __init__(self, model, tokenizer, seed=0):
        self.model, self.version = model, 0
        allowed = [tokenizer.convert_tokens_to_ids(c) for c in map(chr, range(32, 127))]
        self.bias = torch.full((len(tokenizer),), float("-inf"))
        self.bias[allowed] = 0.0
        self.bias[tokenizer.eos_token_id] = 2.0  # replies end by themselves, mostly
        self.eos = tokenizer.eos_token_id
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            ids = []
            for _ in range(params.max_new_tokens):
                logits = self.model(torch.tensor([list(prompt) + ids])).logits[0, -1]
                token = int(torch.multinomial(torch.softmax(logits + self.bias, -1), 1,
                                              generator=self.generator))
                ids.append(token)
                if token == self.eos:
                    break
            stopped = ids[-1] == self.eos
            out.append(Completion(ids, [0.0] * len(ids), "stop" if stopped else "length"))
        return out


def _chat(template: str | None = None) -> ChatFormat:
    tok = tiny_tokenizer()
    if template:
        tok.chat_template = template
    return ChatFormat(tok)


def _same(replayed, played) -> None:
    assert replayed.token_ids == played.token_ids
    assert replayed.loss_mask == played.loss_mask
    assert [(t.start, t.end, t.action) for t in replayed.turns] == [
        (t.start, t.end, t.action) for t in played.turns]


def test_episodes_the_tiny_model_played_retokenise_to_the_same_ids_and_mask():
    model, tok = tiny_model(seed=0)
    chat = ChatFormat(tok)
    engine = RestrictedEngine(model, tok)
    params = SamplingParams(24, 1.0, stop_token_ids=(chat.end_of_turn,))
    episodes = run_sync(run_episodes(lambda: make_env("say-digit", turns=3),
                                     [(i, i) for i in range(6)], engine, chat, params,
                                     max_turns=3))
    stopped = [ep for ep in episodes if all(t.finish_reason == "stop" for t in ep.turns)]
    assert len(stopped) >= 3 and sum(len(ep.turns) for ep in stopped) >= 9
    for played in stopped:
        messages = episode_conversation(chat, played, None, "Say a digit.")
        _same(conversation_episode(chat, messages), played)


@pytest.mark.parametrize("replies", [
    ["4", " 6 ", "Line one\n\n  na\u00efve \u2014 10% & <b>x</b> \U0001f642\n"],
    ["<think>2 and 2.</think>The answer: 4", "\n", "x" * 40],
])
def test_scripted_replies_with_awkward_text_retokenise_exactly(replies):
    chat = _chat()
    engine = ScriptedEngine(chat.tokenizer, replies)
    played, = run_sync(run_episodes(lambda: make_env("say-digit", turns=3), [(0, 0)], engine,
                                    chat, SamplingParams(max_new_tokens=64), max_turns=3))
    assert len(played.turns) == 3
    _same(conversation_episode(chat, episode_conversation(chat, played, None, "Say a digit.")),
          played)


def test_a_tool_episode_retokenises_from_tool_messages_and_from_openai_tool_calls():
    """The loop's tool episode (the call written as text, the result a tool message) and the
    same conversation in OpenAI form (``tool_calls`` + ``tool_call_id``) give the same ids."""
    chat = _chat(WITH_TOOL_CALLS)
    engine = ScriptedEngine(chat.tokenizer, [_hermes("12 * 34"), "408"])
    played, = run_sync(run_episodes(_env, [(0, 0)], engine, chat,
                                    SamplingParams(max_new_tokens=64), max_turns=3))
    assert played.success and len(played.turns) == 2
    tools = [calculator.schema()]
    as_text = [{"role": "system", "content": "Use the calculator."},
               {"role": "user", "content": "What is 12 times 34?"},
               {"role": "assistant", "content": _hermes("12 * 34")},
               {"role": "tool", "name": "calculator", "content": "408"},
               {"role": "assistant", "content": "408"}]
    _same(conversation_episode(chat, as_text, tools), played)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "12 * 34"}'}}
    openai = as_text[:2] + [{"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": "408"},
                            as_text[4]]
    assert conversation_episode(chat, openai, tools).token_ids == played.token_ids


def test_loss_mask_covers_the_replies_and_their_end_of_turn_only():
    chat = _chat()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Ciao"}, {"role": "user", "content": "!"}]
    episode = conversation_episode(chat, messages)
    trained = [i for i, m in enumerate(episode.loss_mask) if m]
    text = chat.tokenizer.decode([episode.token_ids[i] for i in trained])
    assert text == "Hello<|im_end|>Ciao<|im_end|>"
    weighted = conversation_episode(chat, [dict(m, weight=0) if m["content"] == "Hello" else m
                                           for m in messages])
    assert weighted.token_ids == episode.token_ids
    assert chat.tokenizer.decode([t for t, m in zip(weighted.token_ids, weighted.loss_mask,
                                                    strict=True) if m]) == "Ciao<|im_end|>"
    # the trailing user message is left out: a played episode ends with the last reply
    assert chat.tokenizer.decode(episode.token_ids).endswith("assistant\nCiao<|im_end|>")
    assert chat.tokenizer.decode(episode.token_ids) == chat.render(messages[:5], False)[:-1]


STRIPS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DROPS_EARLY_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not "
    "loop.last %}{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_END = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, messages, reason", [
    (STRIPS, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " 6 "}],
     "does not render assistant message messages[1] as its content"),
    (DROPS_EARLY_THINKING, [{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "<think>x</think>4"},
                            {"role": "user", "content": "ok"},
                            {"role": "assistant", "content": "5"}],
     "rewrites the conversation up to assistant message messages[1]"),
    (NO_END, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "4"}],
     "without its end-of-turn token"),
    (None, [{"role": "user", "content": "Hi"}], "no assistant message"),
    (None, [{"role": "assistant", "content": "4"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "4"}], "answers no user message"),
    (None, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "4"},
            {"role": "assistant", "content": "5"}], "both assistant messages"),
    (None, [{"role": "user", "content": "Hi"}, {"role": "system", "content": "x"},
            {"role": "assistant", "content": "4"}], "a system message at messages[1]"),
])
def test_conversations_the_template_cannot_render_exactly_are_refused_with_the_reason(
        template, messages, reason):
    with pytest.raises(DemoError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        conversation_episode(_chat(template), messages)


def test_a_template_that_drops_tool_calls_is_refused():
    chat = _chat(NATIVE)  # tools and tool messages, but no rendering of ``tool_calls``
    call = {"id": "c", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "1"})}}
    with pytest.raises(DemoError, match=r"drops the tool call\(s\) \['calculator'\]"):
        conversation_episode(chat, [{"role": "user", "content": "1?"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c", "content": "1"},
                                    {"role": "assistant", "content": "1"}],
                             [calculator.schema()])


# ---- the JSONL reader -----------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "Say a digit."},
                     {"role": "assistant", "content": "7"}]}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}


def _rows(tmp_path, *lines: str):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _bad_message(message, before=()) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "q"}, *before, message]})


@pytest.mark.parametrize("line, where, message", [
    ('{"messages": [', ":2:", "not valid JSON"),
    ('[1, 2]', ":2:", "a row must be a JSON object, got a list"),
    ('{"conversation": []}', ":2:", "messages: missing"),
    ('{"messages": []}', ":2:", "messages: must be a non-empty list"),
    ('{"messages": "hi"}', ":2:", "messages: must be a non-empty list of messages, got a string"),
    (_bad_message("hi"), ":2:", "messages[1]: must be an object"),
    (_bad_message({"role": "bot", "content": "x"}), ":2:",
     "messages[1].role: 'bot' is not one of system, user, assistant, tool"),
    (_bad_message({"content": "x"}), ":2:", "messages[1].role: missing"),
    (_bad_message({"role": "assistant", "content": 7}), ":2:",
     "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant"}), ":2:", "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant", "content": [{"type": "image_url"}]}), ":2:",
     "messages[1].content: must be a string"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}), ":2:",
     "messages[1].tool_calls[0].id: missing"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}), ":2:",
     "messages[1].tool_calls[0].function.name: missing"),
    (_bad_message({"role": "assistant", "content": None,
                   "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{1"}}]}),
     ":2:", "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    (_bad_message({"role": "assistant", "content": None, "tool_calls": CALL}), ":2:",
     "messages[1].tool_calls: must be a list"),
    (_bad_message({"role": "tool", "content": "2"},
                  [{"role": "assistant", "content": None, "tool_calls": [CALL]}]), ":2:",
     "messages[2].tool_call_id: missing"),
    (_bad_message({"role": "tool", "tool_call_id": "zz", "content": "2"},
                  [{"role": "assistant", "content": None, "tool_calls": [CALL]}]), ":2:",
     "messages[2].tool_call_id: 'zz' answers no earlier tool call"),
    (json.dumps({**GOOD, "tools": [{"type": "function"}]}), ":2:",
     "tools[0].function.name: missing"),
    (_bad_message({"role": "assistant", "content": "x", "weight": 0.5}), ":2:",
     "messages[1].weight: 0.5; only assistant messages take a weight, 0"),
    (_bad_message({"role": "user", "content": "x", "weight": 1}), ":2:",
     "messages[1].weight: 1; only assistant"),
])
def test_a_malformed_row_is_one_line_naming_the_file_line_and_field(tmp_path, line, where,
                                                                    message):
    from turnrl.demos.data import DataError, read_demonstrations

    path = _rows(tmp_path, json.dumps(GOOD), line, json.dumps(GOOD))
    with pytest.raises(DataError) as err:
        read_demonstrations(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}{where} ") and message in text


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_an_empty_file_says_so(tmp_path, content):
    from turnrl.demos.data import DataError, read_demonstrations

    path = tmp_path / "demos.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="no conversations"):
        read_demonstrations(path)
    with pytest.raises(DataError, match="is not a file"):
        read_demonstrations(tmp_path / "missing.jsonl")


def test_rows_come_back_normalised(tmp_path):
    from turnrl.demos.data import read_demonstrations

    tool_row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "1+"},
                                                          {"type": "text", "text": "1?"}]},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "c1", "content": "2"},
                             {"role": "assistant", "content": "2"}],
                "tools": [calculator.schema()]}
    path = _rows(tmp_path, json.dumps(GOOD), "", json.dumps(tool_row))
    first, second = read_demonstrations(path)
    assert first.where == f"{path}:1" and first.tools is None
    assert second.where == f"{path}:3" and second.tools == [calculator.schema()]
    assert second.messages[0]["content"] == "1+1?"
    assert second.messages[1]["content"] == ""
    assert second.messages[2]["name"] == "calculator"


# ---- training -------------------------------------------------------------------------------

def test_the_training_loss_equals_the_reference_nll_over_full_logits(tiny):
    """``policy_nll`` runs the LM head on the assistant's tokens only; the value is the one
    ``assistant_nll`` computes from the full logits."""
    from turnrl.sft.train import assistant_nll, policy_nll
    from turnrl.types import Batch

    model, tok = tiny
    chat = ChatFormat(tok)
    episodes = [conversation_episode(chat, [{"role": "user", "content": f"Add {i} and 2."},
                                            {"role": "assistant", "content": str(i + 2)}])
                for i in range(3)]
    batch = Batch.from_episodes(episodes, torch.zeros(3), tok.pad_token_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = assistant_nll(logits, batch.input_ids, batch.loss_mask)
    got = policy_nll(model, batch)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    assert float(got[1]) == float(expected[1]) > 0


def test_assistant_nll_scores_masked_tokens_from_the_previous_position():
    from turnrl.sft.train import assistant_nll

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 1, 1]])
    total, count = assistant_nll(logits, ids, mask)
    logp = torch.log_softmax(logits, -1)
    expected = -sum(float(logp[b, t - 1, ids[b, t]]) for b in range(2) for t in range(1, 5)
                    if mask[b, t])
    assert count == 5 and total.item() == pytest.approx(expected, rel=1e-5)
    assert assistant_nll(logits, ids, torch.zeros_like(mask))[1] == 0


def test_step_batches_cover_every_conversation_once_an_epoch_and_split_is_seeded():
    from turnrl.sft.train import split, step_indices

    stream = [i for step in range(6) for i in step_indices(10, 5, step, seed=3)]
    assert all(sorted(stream[e * 10:(e + 1) * 10]) == list(range(10)) for e in range(3))
    assert stream[:10] != stream[10:20]  # each epoch is shuffled afresh
    assert step_indices(10, 5, 4, seed=3) == stream[20:25]  # a pure function of the step
    assert step_indices(10, 5, 0, seed=4) != stream[:5]
    train, held = split(10, 0.25, seed=0)
    assert len(held) == 3 and sorted(train + held) == list(range(10))
    assert split(2, 0.01, 0)[1] and split(1, 0.5, 0) == ([0], []) and not split(5, 0, 0)[1]


TESTS = Path(__file__).parents[1]
TINY = ["--model.name", "tiny", "--env.name", "say-digit", "--rollout.max_new_tokens", "3",
        "--run.progress", "false", "--run.tensorboard", "false"]


def _cli(command, *args):
    return [sys.executable, "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import conftest; "
            "from turnrl.cli import main; sys.exit(main(sys.argv[2:]))",
            str(TESTS), command, *TINY, *args]


def _digit_demos(path, count=24, seed=0):
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": "Say a digit."},
        {"role": "assistant", "content": str(rng.randrange(10))}]}) + "\n"
        for _ in range(count)))
    return path


def test_sft_command_logs_losses_writes_checkpoints_and_refuses_bad_input(tmp_path, capsys):
    from turnrl.metrics import read_metrics

    data = _digit_demos(tmp_path / "demos.jsonl", 12)
    out = tmp_path / "run"
    done = subprocess.run(_cli("sft", "--sft.data", str(data), "--run.out_dir", str(out),
                               "--run.steps", "4", "--run.checkpoint_every", "2",
                               "--sft.batch_size", "4", "--optim.micro_batch_size", "3",
                               "--optim.lr", "1e-2"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "10 sequences to train on, 2 held out, 0 skipped" in done.stdout
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["sft/tokens"] == 8 for r in records)  # 4 replies: a digit and an end of turn
    assert [("eval/loss" in r) for r in records] == [False, True, False, True]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002",
                                                                       "step-000004"]
    from turnrl.report import write_html_report

    page = Path(write_html_report([str(out)], str(tmp_path / "report.html"))).read_text()
    assert "sft/loss" in page and "eval/loss" in page  # the run report draws both losses
    # a malformed file, a file with nothing the template can render, no file: one line, exit 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + '{"messages": [{"role": "user"}]}\n')
    unfit = tmp_path / "unfit.jsonl"
    unfit.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    for args, message in [(["--sft.data", str(bad)], f"{bad}:2: messages[0].content: must be"),
                          (["--sft.data", str(unfit)], "nothing to train on: all 1 rows"),
                          ([], "turnrl sft needs --sft.data"),
                          (["--sft.data", str(data), "--sft.eval_fraction", "1"],
                           "sft.eval_fraction must be in [0, 1)")]:
        from turnrl.cli import main

        assert main(["sft", *TINY, "--run.out_dir", str(tmp_path / "r2"), *args]) == 2
        stderr = capsys.readouterr().err
        errors = [line for line in stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0], stderr
        if "nothing" in message:
            assert f"sft: {unfit}:1: skipped: no assistant message" in stderr
    assert not (tmp_path / "r2" / "checkpoints").exists()  # nothing trained


def test_unfit_conversations_are_skipped_with_their_line_or_refused(tiny):
    from turnrl.demos.data import DataError, parse_row
    from turnrl.sft.train import tokenise

    chat = ChatFormat(tiny[1])
    rows = [parse_row(json.dumps(GOOD), "d.jsonl:1"),
            parse_row(json.dumps({"messages": [{"role": "user", "content": "x"}]}), "d.jsonl:2"),
            parse_row(json.dumps({"messages": GOOD["messages"] * 2}), "d.jsonl:3"),
            parse_row(json.dumps({"messages": [GOOD["messages"][0],
                                               {"role": "assistant", "content": "9" * 60}]}),
                      "d.jsonl:4")]
    episodes, skipped = tokenise(chat, rows, skip_unfit=True, max_tokens=80)
    assert [ep.info["source"] for ep in episodes] == ["d.jsonl:1", "d.jsonl:3"]
    assert skipped == [
        "d.jsonl:2: skipped: no assistant message: nothing to train on",
        "d.jsonl:4: skipped: 92 tokens, longer than the model's context of 80"]
    with pytest.raises(DataError, match="d.jsonl:2: no assistant message"):
        tokenise(chat, rows, skip_unfit=False, max_tokens=80)


def test_an_interrupted_sft_run_resumes_bit_for_bit(tmp_path):
    """SIGKILL mid-run, resume: the weights, optimiser state and logged losses equal those of
    a run never interrupted (as tests/trainer/test_train.py checks for RL)."""
    from safetensors.torch import load_file

    from turnrl.metrics import read_metrics

    data = _digit_demos(tmp_path / "demos.jsonl", 20)
    common = ["--sft.data", str(data), "--run.checkpoint_every", "2", "--sft.batch_size", "3",
              "--optim.micro_batch_size", "2", "--optim.lr", "1e-2", "--sft.eval_every", "1"]
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli("sft", *common, "--run.out_dir", str(out),
                                 "--run.steps", "400"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = out / "checkpoints"
    # Loose: a process's start on a busy machine can take a minute; a checkpoint at step 4 or
    # later, whichever the ones kept (step-00000[4-9] could be missed)
    deadline = time.monotonic() + 600
    while (time.monotonic() < deadline and proc.poll() is None
           and max((int(p.name.split("-")[1]) for p in checkpoints.glob("step-*")),
                   default=0) < 4):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resume_from = int(sorted(p.name for p in checkpoints.glob("step-*"))[-1].split("-")[1])
    assert resume_from < 400
    final = resume_from + 4
    done = subprocess.run(_cli("sft", *common, "--run.out_dir", str(out), "--run.steps",
                               str(final), "--resume"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"from step {resume_from}" in done.stdout
    straight = tmp_path / "straight"
    subprocess.run(_cli("sft", *common, "--run.out_dir", str(straight), "--run.steps",
                        str(final)), check=True, capture_output=True, timeout=300)
    last = f"checkpoints/step-{final:06d}"
    resumed, uninterrupted = (load_file(d / last / "model.safetensors") for d in (out, straight))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    moments = [torch.load(d / last / "optimizer.pt", weights_only=False)["state"]
               for d in (out, straight)]
    assert all(torch.equal(a[k], b[k]) for a, b in [(moments[0][i], moments[1][i])
                                                    for i in moments[0]] for k in a)
    logged = [[(r["step"], r["sft/loss"], r["eval/loss"]) for r in read_metrics(d / "metrics.jsonl")]
              for d in (out, straight)]
    assert logged[0] == logged[1] and [s for s, _, _ in logged[0]] == list(range(1, final + 1))


def test_sft_on_say_digit_demonstrations_makes_the_tiny_model_succeed(tmp_path):
    """A handful of demonstrations (24 one-digit replies) and 20 steps: the held-out
    demonstrations' NLL falls and the tiny model's held-out success on the task rises; its
    checkpoint then starts an RL run (``--model.name CHECKPOINT``) as the model it became."""
    from safetensors.torch import load_file

    from turnrl.config import load_config
    from turnrl.models import load_model
    from turnrl.sft.train import sft
    from turnrl.trainer import train

    data = _digit_demos(tmp_path / "demos.jsonl", 24)
    cfg = load_config(None, TINY + ["--sft.data", str(data), "--run.out_dir",
                                    str(tmp_path / "sft"), "--run.steps", "20",
                                    "--optim.lr", "1e-2", "--sft.eval_fraction", "0.25",
                                    "--sft.eval_env", "true", "--eval.episodes", "32"])
    result = sft(cfg)
    assert result.train_conversations == 18 and result.held_out_conversations == 6
    assert result.loss_after < result.loss_before - 1.5  # nats per assistant token
    assert result.before.success_rate < 0.2
    assert result.after.success_rate > result.before.success_rate + 0.3

    checkpoint = result.run_dir / "checkpoints" / "step-000020"
    model, _ = load_model(str(checkpoint))
    saved = load_file(checkpoint / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)
    rl = train(load_config(None, TINY + ["--model.name", str(checkpoint), "--run.out_dir",
                                         str(tmp_path / "rl"), "--run.steps", "1",
                                         "--eval.episodes", "32"]))
    assert rl.before.success_rate == pytest.approx(result.after.success_rate, abs=0.3)
    assert rl.before.success_rate > result.before.success_rate + 0.2


# ---- token-level rows: turnrl serve recordings and a run's episodes ---------------------------

def _record(recorder, chat, episode_id, replies, reward, extra_id=None):
    """Record a served conversation through the server's own ``Recorder``: each call's prompt
    is the template's render so far, its sampled ids the reply and the end of turn."""
    from turnrl.serve.record import Call

    messages, rendered, prompt = chat.start("Say a digit.")
    for i, reply in enumerate(replies):
        sampled = chat.encode(reply) + [chat.end_of_turn]
        if extra_id is not None and i == 0:
            sampled = [extra_id] + sampled
        recorder.record(episode_id, Call(prompt, rendered, sampled, [-0.1] * len(sampled), 0,
                                         reply + chat.end_of_turn_text))
        rendered, delta = chat.continue_after(messages, rendered, reply, True, "Again.")
        prompt = prompt + sampled + delta
    recorder.set_reward(episode_id, reward)


def test_serve_recordings_and_run_episodes_train_as_recorded(tmp_path, tiny):
    from turnrl.demos.data import read_demonstrations
    from turnrl.serve.record import Recorder
    from turnrl.sft.train import tokenise
    from turnrl.types import write_episodes

    model, tok = tiny
    chat = ChatFormat(tok)
    recorder = Recorder(str(tmp_path / "served"))
    _record(recorder, chat, "good", ["7", "3"], 1.0)
    _record(recorder, chat, "bad", ["x"], 0.0)
    _record(recorder, chat, "alien", ["5"], 1.0, extra_id=len(tok) + 5)
    recorded = {e: recorder.episodes[e].segments for e in ("good", "bad")}
    rows = read_demonstrations(tmp_path / "served" / "episodes.jsonl")
    episodes, skipped = tokenise(chat, rows, skip_unfit=True, max_tokens=1024, min_reward=0.5)
    assert [ep.info["episode_id"] for ep in episodes] == ["good"]
    assert episodes[0].token_ids == recorded["good"][0].token_ids
    assert episodes[0].loss_mask == recorded["good"][0].loss_mask
    # the recording is the turn loop's tokenisation of the same conversation
    conversation = [{"role": "user", "content": "Say a digit."},
                    {"role": "assistant", "content": "7"}, {"role": "user", "content": "Again."},
                    {"role": "assistant", "content": "3"}]
    assert conversation_episode(chat, conversation).token_ids == episodes[0].token_ids
    assert [line.split(": ", 1)[1] for line in skipped] == [
        "left out: reward 0 is below sft.min_reward 0.5",
        f"skipped: token id {len(tok) + 5} is outside the model's vocabulary of {len(tok)} "
        "(recorded with another model?)"]

    played = run_sync(run_episodes(lambda: make_env("say-digit", turns=2), [(0, 0), (1, 1)],
                                   RestrictedEngine(model, tok), chat,
                                   SamplingParams(8, 1.0, stop_token_ids=(chat.end_of_turn,)),
                                   max_turns=2))
    write_episodes(tmp_path / "step.jsonl", played)
    episodes, skipped = tokenise(chat, read_demonstrations(tmp_path / "step.jsonl"),
                                 skip_unfit=True, max_tokens=1024, min_reward=-1)
    assert not skipped
    assert [(e.token_ids, e.loss_mask) for e in episodes] == [(p.token_ids, p.loss_mask)
                                                             for p in played]


@pytest.mark.parametrize("row, message", [
    ({"episode_id": "a", "segments": []}, "segments: must be a non-empty list"),
    ({"episode_id": "a", "segments": [{"token_ids": [1, "2"], "loss_mask": [0, 1]}]},
     "segments[0].token_ids: must be a non-empty list of token ids"),
    ({"episode_id": "a", "segments": [{"token_ids": [1, 2], "loss_mask": [0]}]},
     "segments[0].loss_mask: must be a list of 0/1, one per token id (2)"),
    ({"token_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask: must be a list of 0/1"),
    ({"token_ids": [1, 2], "loss_mask": [0, 1], "reward": "high"},
     "reward: must be a finite number or null, got a string"),
])
def test_malformed_token_rows_are_one_line_errors(tmp_path, row, message):
    from turnrl.demos.data import DataError, read_demonstrations

    path = _rows(tmp_path, json.dumps(row))
    with pytest.raises(DataError) as err:
        read_demonstrations(path)
    assert str(err.value).startswith(f"{path}:1: ") and message in str(err.value)


# ---- scripted demonstrations from an env's reference player -----------------------------------

def test_env_demos_train_alone_and_an_env_without_a_player_is_refused(tmp_path):
    from turnrl.config import load_config
    from turnrl.demos.data import DataError
    from turnrl.sft.train import sft

    base = ["--model.name", "tiny", "--run.progress", "false", "--run.tensorboard", "false",
            "--run.steps", "2", "--sft.env_demos", "4"]
    result = sft(load_config(None, base + ["--env.name", "guess-number",
                                           "--run.out_dir", str(tmp_path / "a")]))
    assert result.train_conversations + result.held_out_conversations == 4
    assert result.loss_after < result.loss_before
    with pytest.raises(DataError, match=r"env 'say-digit' offers no scripted demonstrations "
                                        r"\(no reference_player\(\); built-in ones: guess-number"):
        sft(load_config(None, base + ["--env.name", "say-digit",
                                      "--run.out_dir", str(tmp_path / "b")]))


@register_env("secret-word")
class SecretWord:
    """A task only an oracle solves: say the seed's hidden word (its reference player reads
    it from the env, the way an adapter's player reads a dataset's answer)."""

    async def reset(self, seed: int) -> str:
        self.word = ["apple", "river", "stone", "cloud"][seed % 4]
        return "Say the secret word."

    async def step(self, action: str) -> StepResult:
        ok = action.strip() == self.word
        return StepResult("", float(ok), True, {"success": ok})

    def reference_player(self):
        env = self

        class Oracle:
            def reset(self, first_observation: str) -> None:
                pass

            def act(self, observation: str) -> str:
                return env.word

        return Oracle()


def test_an_env_s_own_reference_player_writes_its_demonstrations():
    from turnrl.demos.scripted import env_demonstrations

    chat = ChatFormat(tiny_tokenizer())
    demos, failed = env_demonstrations("secret-word", {}, 6, chat, max_turns=1)
    assert failed == [] and len(demos) == 6
    assert [d.episodes[0].turns[-1].action for d in demos[:5]] == [
        "apple", "river", "stone", "cloud", "apple"]


# ---- local Hugging Face datasets ------------------------------------------------------------

def test_local_hugging_face_datasets_read_as_their_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")  # an optional dependency
    from turnrl.demos.data import DataError, read_demonstrations

    tool_row = {"messages": [{"role": "user", "content": "1+1?"},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "c1", "content": "2"},
                             {"role": "assistant", "content": "2"}],
                "tools": [calculator.schema()]}
    rows = [GOOD, tool_row, {"messages": GOOD["messages"] * 2}]
    expected = read_demonstrations(_rows(tmp_path, *map(json.dumps, rows)))
    # from_list takes its columns from the first row: a dataset has "tools" on every row
    table = datasets.Dataset.from_list([{"tools": None, **row} for row in rows])
    table.to_parquet(str(tmp_path / "demos.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "splits"))
    for path in ("demos.parquet", "saved", "splits"):
        got = read_demonstrations(tmp_path / path)
        assert [(d.messages, d.tools) for d in got] == [(d.messages, d.tools)
                                                        for d in expected], path
        assert got[1].where == f"{tmp_path / path}: row 2"
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "test-only"))
    with pytest.raises(DataError, match="no 'train' split \\(it has test\\)"):
        read_demonstrations(tmp_path / "test-only")
    datasets.Dataset.from_list([GOOD, {"conversation": "x"}]).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=f"{tmp_path / 'b.parquet'}: row 2: messages: missing"):
        read_demonstrations(tmp_path / "b.parquet")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet': cannot be read as a dataset"):
        read_demonstrations(tmp_path / "junk.parquet")


# ---- the warm-up stage of turnrl train ------------------------------------------------------

def test_train_with_a_warm_up_stage_starts_rl_from_the_sft_checkpoint_and_resumes(tmp_path):
    import yaml

    from turnrl.config import ConfigError, load_config
    from turnrl.launch import train
    from turnrl.metrics import read_metrics

    data = _digit_demos(tmp_path / "demos.jsonl", 24)
    out = tmp_path / "run"
    args = TINY + ["--sft.data", str(data), "--sft.steps", "20", "--sft.lr", "1e-2",
                   "--run.out_dir", str(out), "--eval.episodes", "32"]
    result = train(load_config(None, args + ["--run.steps", "1"]))
    warm = out / "sft" / "checkpoints" / "step-000020"
    assert warm.is_dir() and (out / "checkpoints" / "step-000001").is_dir()
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["name"] == str(warm) and saved["optim"]["lr"] == 4e-5
    assert yaml.safe_load((out / "sft" / "config.yaml").read_text())["optim"]["lr"] == 1e-2
    assert result.before.success_rate > 0.3  # RL's "before" is the warmed-up model
    sft_steps = [r["step"] for r in read_metrics(out / "sft" / "metrics.jsonl")]
    assert sft_steps == list(range(1, 21))

    with pytest.raises(ConfigError, match="already has checkpoints; pass --resume"):
        train(load_config(None, args + ["--run.steps", "1"]))  # never silently redone
    # resuming a finished warm-up runs RL on from its checkpoint, not the warm-up again
    resumed = train(load_config(str(out / "config.yaml"), ["--run.steps", "2"]), resume=True)
    assert resumed.steps == 2 and (out / "checkpoints" / "step-000002").is_dir()
    assert [r["step"] for r in read_metrics(out / "sft" / "metrics.jsonl")] == sft_steps


def test_an_interrupted_warm_up_resumes_then_rl_starts_as_if_never_stopped(tmp_path):
    from safetensors.torch import load_file

    from turnrl.config import load_config
    from turnrl.launch import train
    from turnrl.sft.train import sft
    from turnrl.sft.warmup import stage_config

    data = _digit_demos(tmp_path / "demos.jsonl", 12)
    args = TINY + ["--sft.data", str(data), "--sft.steps", "6", "--sft.lr", "1e-2",
                   "--run.steps", "1", "--eval.episodes", "0", "--run.checkpoint_every", "2"]
    straight = tmp_path / "straight"
    train(load_config(None, args + ["--run.out_dir", str(straight)]))
    cut = tmp_path / "cut"
    cfg = load_config(None, args + ["--run.out_dir", str(cut)])
    stage = stage_config(cfg, cut / "sft", cut / "sft" / "checkpoints" / "step-000006")
    # what a kill after the warm-up's step-4 checkpoint leaves (a shorter run, then extended)
    sft(replace(stage, run=replace(stage.run, steps=4)))
    train(cfg, resume=True)
    for name in ("sft/checkpoints/step-000006", "checkpoints/step-000001"):
        a, b = (load_file(d / name / "model.safetensors") for d in (straight, cut))
        assert all(torch.equal(a[k], b[k]) for k in a), name
