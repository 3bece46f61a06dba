"""``simulated-user``: a dialogue in which another model plays a user with a hidden goal.

The REFUEL (Gao et al. 2024, arXiv:2410.04612) and DoctorAgent-RL (Feng et al. 2025,
arXiv:2505.19630) shape: a user, played from a persona and a hidden goal, opens the dialogue;
the policy asks questions, one a turn, and acts when it knows enough (``answer: NAME``). The
shipped tasks (``data/simulated_users.jsonl``) are patients: the goal describes their
symptoms, the answer is the diagnosis the doctor (the policy) must name.

Who plays the user (``opponent``, the self-play path: docs/selfplay.md, docs/simulated_users.md):

- ``scripted``: a deterministic rule over the task's ``facts``: a question naming one fact word
  gets "Yes."/"No."; anything else a fixed request to ask about one thing. Testable, cheap,
  learnable by a small model.
- ``model``: a local model (``env.opponent_model``: a directory, smollm2-135m-instruct, tiny),
  its replies sampled in batches across episodes as a frozen opponent's moves are
  (``turnrl.selfplay.opponents.FrozenPolicy``).
- ``endpoint``: any OpenAI-compatible endpoint (``env.opponent_endpoint``).

What each side sees. The user sees its persona, its goal and the dialogue, never the task's
``answer`` nor how the policy is scored. The policy sees the opening line, the user's replies
and (``show_choices``) the list of possible answers, never the goal: a model user's reply that
names the answer (or an alias) has it replaced by "[...]" (counted in ``info["redacted"]``).

Success is checked: the final reply names the task's answer (or an alias) and no other choice;
it pays ``1 - turn_cost * (turns - 1)``. ``reward: judge`` leaves the env's reward at 0 for an
LLM judge (the ``judge`` section) to score; the judge is told the hidden goal and answer
(``info["judge_reference"]``, never shown to the policy). Tasks come from the shipped file or
``path`` (JSONL, CSV, parquet, a datasets directory) with the dataset env's real train/eval
split (envs/dataset.py: a ``split`` column, ``eval_path``, or a hashed ``eval_fraction``).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from turnrl.envs.base import StepResult, register_env
from turnrl.envs.dataset import DatasetError, check_split, load_splits, row_order, where_of

USERS = ("scripted", "model", "endpoint")
REDACTED = "[...]"
_CHECKED: set[tuple[int, bool]] = set()  # (the loaded rows' id, scripted) that passed checks
SYSTEM = ("A user has come to you with a problem. Find out what it is by asking questions, one "
          "short question a turn; the user answers. {vocabulary}When you are sure, reply "
          "'answer: NAME'{choices}. You have {turns} turns.")
USER_SYSTEM = ("You are role-playing a user talking to an assistant. Who you are: {persona}\n"
               "Your situation: {goal}\nAnswer the assistant's last message truthfully from "
               "your situation, in one short sentence, as this person would. Never write the "
               "assistant's lines.")


def shipped_tasks() -> str:
    return str(resources.files("turnrl.envs").joinpath("data/simulated_users.jsonl"))


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def names(text: str, phrase: str) -> bool:
    """Whether ``text`` contains ``phrase`` as whole words (case-insensitive)."""
    return re.search(rf"(?<![a-z]){re.escape(phrase.lower())}(?![a-z])", text.lower()) is not None


def redact(text: str, phrases: list[str]) -> tuple[str, int]:
    """``text`` with every whole-word ``phrases`` match replaced by ``REDACTED``, and how many
    were (longest first, so an alias containing the answer goes whole)."""
    count = 0
    for phrase in sorted(phrases, key=len, reverse=True):
        text, n = re.subn(rf"(?<![a-zA-Z]){re.escape(phrase)}(?![a-zA-Z])", REDACTED, text,
                          flags=re.IGNORECASE)
        count += n
    return text, count


def scripted_reply(question: str, facts: set[str], vocabulary: set[str]) -> str:
    """The scripted user's answer: yes/no when ``question`` names exactly one fact word (a
    plural -s or -es form counts), else a request to ask about one thing."""
    asked = {w for word in words(question)
             for w in (word, word.removesuffix("s"), word.removesuffix("es")) if w in vocabulary}
    if len(asked) != 1:
        return ("Sorry, I don't follow. Ask me about one thing." if not asked
                else "One thing at a time, please.")
    return "Yes." if asked.pop() in facts else "No."


def final_answer(action: str) -> str | None:
    """The text after ``answer:`` in the reply (None: the reply is a question)."""
    match = re.search(r"answer\s*:\s*(.+)", action, re.IGNORECASE | re.DOTALL)
    return match.group(1).strip() if match else None


def is_correct(answer: str, row: dict, choices: list[str]) -> bool:
    """``answer`` names the row's answer (or an alias) and no other choice."""
    mine = [row["answer"], *row.get("aliases", [])]
    others = [c for c in choices if c != row["answer"] and not any(names(c, m) for m in mine)]
    return any(names(answer, m) for m in mine) and not any(names(answer, c) for c in others)


def check_tasks(rows: list[dict], where: str, scripted: bool) -> None:
    """Each row has a goal and an answer (and facts for the scripted user): one line naming
    the first that does not by its file line or row (``where_of``), as the user wrote it."""
    if not rows:
        raise DatasetError(f"{where} has no rows; give the tasks an eval split (a 'split' "
                           "column, eval_path) or raise eval_fraction")
    for number, row in enumerate(rows):
        at = where_of(row, f"{where} row {number}")
        for field in ("goal", "answer"):
            if not isinstance(row.get(field), str) or not row[field].strip():
                raise DatasetError(f"{at}: no '{field}' text")
        aliases = row.get("aliases", [])
        if not (isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
            raise DatasetError(f"{at}: 'aliases' must be a list of names")
        facts = row.get("facts")
        if scripted and not (isinstance(facts, list) and all(isinstance(f, str) for f in facts)):
            raise DatasetError(f"{at}: no 'facts' list, which the scripted user answers from; "
                               "add one or use --env.options.opponent model")


def check_numbers(max_turns: Any, turn_cost: Any, show_choices: Any) -> None:
    """One line naming the first option of the wrong type or range (a string turn_cost would
    otherwise fail every correct answer at step time)."""
    number = (int, float)
    for name, value, ok, want in [
            ("max_turns", max_turns, isinstance(max_turns, int) and not isinstance(max_turns, bool)
             and max_turns >= 1, "an int >= 1"),
            ("turn_cost", turn_cost, isinstance(turn_cost, number)
             and not isinstance(turn_cost, bool) and turn_cost >= 0, "a number >= 0"),
            ("show_choices", show_choices, isinstance(show_choices, bool), "true or false")]:
        if not ok:
            raise ValueError(f"simulated-user: {name} must be {want}, got {value!r}")


@register_env("simulated-user")
class SimulatedUser:
    """Dialogue with a simulated user (persona + hidden goal): ask, then 'answer: NAME'; the
    user scripted, a local model or an endpoint (docs/simulated_users.md)."""

    def __init__(self, opponent: str = "scripted", path: str = "", split: str = "train",
                 eval_path: str = "", eval_fraction: float = 0.25, split_column: str = "split",
                 shuffle_seed: int = 0, max_turns: int = 6, turn_cost: float = 0.05,
                 show_choices: bool = True, reward: str = "check"):
        if opponent not in USERS:
            raise ValueError(f"simulated-user opponent must be one of {', '.join(USERS)} (who "
                             f"plays the user), got {opponent!r}")
        if reward not in ("check", "judge"):
            raise ValueError(f"simulated-user: use reward check or judge, got {reward!r}")
        check_split("simulated-user", split, eval_fraction)
        check_numbers(max_turns, turn_cost, show_choices)
        path = path or shipped_tasks()
        train, held = load_splits(path, eval_path, split_column, eval_fraction)
        if (id(train), opponent == "scripted") not in _CHECKED:  # built per episode: once
            check_tasks(train, f"{path} (train split)", opponent == "scripted")
            check_tasks(held, f"{path} (eval split)", opponent == "scripted")
            _CHECKED.add((id(train), opponent == "scripted"))
        self.rows = train if split == "train" else held
        self.choices = sorted({r["answer"] for r in (*train, *held)})
        self.vocabulary = sorted({f for r in (*train, *held) for f in r.get("facts", [])})
        self.table: dict[str, frozenset[str]] = {}  # answer -> its facts: public knowledge
        for row in (*train, *held):
            self.table.setdefault(row["answer"], frozenset(row.get("facts", [])))
        self.opponent_option, self.split, self.reward_mode = opponent, split, reward
        self.shuffle_seed, self.max_turns, self.turn_cost = shuffle_seed, max_turns, turn_cost
        self.eval_options = {"split": "eval"}  # held-out evaluation plays the eval rows
        self.cooperative = opponent == "scripted"  # a model or socket user blocks its thread
        asked = f"You may ask about: {', '.join(self.vocabulary)}. " if self.vocabulary else ""
        listed = f", NAME one of: {', '.join(self.choices)}" if show_choices else ""
        self.system_prompt = SYSTEM.format(vocabulary=asked, choices=listed, turns=max_turns)
        self.player: Any = None
        self.row: dict = {}
        self.dialogue: list[tuple[str, str]] = []
        self.turn = self.redacted = 0

    def reference_player(self) -> Questioner:
        """Asks the fact that best splits the answers still possible, then names the last
        one (scripted demonstrations, guidance; it reads only what the policy reads and the
        file's public table of which facts go with which answer)."""
        return Questioner(self.table)

    def set_opponent(self, player: Any) -> None:
        """The model or endpoint user (``act(system_prompt, observation) -> str``, ``name``),
        handed over by the trainer as a self-play opponent is."""
        self.player = player

    @property
    def user(self) -> str:
        if self.opponent_option == "scripted":
            return "scripted"
        return getattr(self.player, "name", self.opponent_option)

    async def reset(self, seed: int) -> str:
        index = (row_order(seed, len(self.rows), self.shuffle_seed) if self.split == "train"
                 else seed % len(self.rows))
        self.row, self.turn, self.redacted = self.rows[index], 0, 0
        opening = str(self.row.get("opening") or "Hello.")
        self.dialogue = [("user", opening)]
        return opening

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        answer = final_answer(action)
        if answer is not None:
            success = is_correct(answer, self.row, self.choices)
            reward = max(0.0, 1.0 - self.turn_cost * (self.turn - 1)) if success else 0.0
            return StepResult("", reward if self.reward_mode == "check" else 0.0, True,
                              self._info(success, True))
        self.dialogue.append(("assistant", action.strip()))
        reply = self._user_reply(action)
        self.dialogue.append(("user", reply))
        done = self.turn >= self.max_turns
        return StepResult(reply, 0.0, done, self._info(False, done))

    def _user_reply(self, action: str) -> str:
        """The user's answer to ``action``, with the hidden answer redacted."""
        if self.opponent_option == "scripted":
            return scripted_reply(action, set(self.row["facts"]), set(self.vocabulary))
        if self.player is None:
            raise RuntimeError(f"simulated-user opponent '{self.opponent_option}' has no player: "
                               "the trainer hands one over (env.opponent_model or "
                               "env.opponent_endpoint)")
        system, observation = user_chat(self.row, self.dialogue)
        text = self.player.act(system, observation).strip()
        text = text.splitlines()[0].strip() if text else ""
        text, count = redact(text, [self.row["answer"], *self.row.get("aliases", [])])
        self.redacted += count
        return text or "..."

    def _info(self, success: bool, done: bool) -> dict:
        """The step's facts; at the end, what a judge is told and the policy never sees."""
        info = {"success": success, "turns": self.turn, "user": self.user,
                "redacted": self.redacted}
        if done:
            info["judge_reference"] = (f"The user's situation: {self.row['goal']} The right "
                                       f"answer: {self.row['answer']}.")
        return info


def user_chat(row: dict, dialogue: list[tuple[str, str]]) -> tuple[str, str]:
    """(system prompt, observation) the user model answers: its persona, goal and the dialogue
    so far; never the task's answer, aliases or how the assistant is scored."""
    system = USER_SYSTEM.format(persona=row.get("persona") or "an ordinary person.",
                                goal=row["goal"])
    lines = [f"{'You' if who == 'user' else 'Assistant'}: {text}" for who, text in dialogue]
    return system, "\n".join(lines) + "\nYou:"


class Questioner:
    """The scripted user's reference player: bisects the answers whose facts agree with
    every reply so far, asking the fact closest to splitting them in half."""

    def __init__(self, table: dict[str, frozenset[str]]) -> None:
        self.table = table
        self.facts = sorted(set().union(*table.values()))

    def reset(self, first_observation: str) -> None:
        self.possible, self.asked = set(self.table), ""

    def act(self, observation: str) -> str:
        if self.asked and observation in ("Yes.", "No."):
            said = observation == "Yes."
            self.possible = {a for a in self.possible if (self.asked in self.table[a]) == said}
        unasked = [f for f in self.facts if 0 < sum(f in self.table[a] for a in self.possible)
                   < len(self.possible)]
        if len(self.possible) <= 1 or not unasked:
            return f"answer: {min(self.possible) if self.possible else 'unknown'}"
        self.asked = min(unasked, key=lambda f: abs(2 * sum(
            f in self.table[a] for a in self.possible) - len(self.possible)))
        return f"{self.asked}?"
