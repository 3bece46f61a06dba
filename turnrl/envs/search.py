"""``search``: multi-hop questions answered by searching a local corpus (issue 54).

A fictional world is generated from ``world_seed``: countries, cities, people, companies,
rivers, languages and mountains, each with a few facts ("The capital of Zorland is Quen.")
and one document per entity that states its facts and the facts naming it ("Quen is the
capital of Zorland."). Questions follow ``hops`` facts from an entity: "What is the river of
the capital of Zorland?" needs the capital first, then its river. The policy has two tools
over the corpus (turnrl/tools/search.py): ``search(query)``, BM25's ``top_k`` hits as
"doc_id | title | snippet" lines, and ``open(doc_id)``, a document's text. The reward is
1 when the final answer ("Answer: Avo", ``\\boxed{Avo}``, or a reply that is just the name)
equals the answer, ignoring case, spaces and a leading "the".

Splits: every question of the world is in train or eval by a stable hash of its text
(``eval_fraction``); training seeds walk shuffled epochs of the training questions, held-out
evaluation builds the env with ``split: eval`` (``eval_options``) and draws only eval ones.
The reference player (``Searcher``) reads only what the policy reads: it searches each hop's
relation and entity, takes the fact from a snippet, or opens the entity's document when no
snippet states it, and answers after the last hop.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re

from turnrl.envs.base import register_env
from turnrl.envs.dataset import check_split
from turnrl.envs.tool_env import Task, ToolEnv
from turnrl.rewards import final_answer
from turnrl.tools import render_call
from turnrl.tools.search import BM25, STOPWORDS, Document, search_tools

KINDS: dict[str, tuple[float, tuple[tuple[str, str], ...]]] = {
    "country": (0.10, (("capital", "city"), ("leader", "person"), ("language", "language"))),
    "city": (0.25, (("river", "river"), ("mayor", "person"))),
    "person": (0.30, (("birthplace", "city"), ("employer", "company"))),
    "company": (0.10, (("headquarters", "city"), ("founder", "person"))),
    "river": (0.10, (("source", "mountain"),)),
    "language": (0.05, ()),
    "mountain": (0.10, ()),
}
"""kind -> (share of the documents, its facts as (relation, kind of the value))."""
_ONSETS, _VOWELS, _CODAS = "b d f g k l m n p r s t v z br dr kr st th".split(), "aeiou", "lnrsx"
_SUFFIX = {"country": ("land", "ia", "stan"), "river": ("a",), "language": ("ish",)}
INSTRUCTIONS = "Search the documents, one fact per search. Then reply: Answer: NAME"
"""Short: the tiny test model reads characters, 1024 at most, tool schemas included."""


@functools.lru_cache(maxsize=8)
def build_world(world_seed: int, docs: int) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """(entity -> kind, (entity, relation) -> value): the world's facts, deterministic."""
    rng = random.Random(f"search-world-{world_seed}")
    kinds, used = {}, set(STOPWORDS) | {r for _, rels in KINDS.values() for r, _ in rels}
    for kind, (share, _) in KINDS.items():
        for _ in range(max(2, round(share * docs))):
            kinds[_fresh_name(rng, kind, used)] = kind
    by_kind: dict[str, list[str]] = {}
    for name, kind in kinds.items():
        by_kind.setdefault(kind, []).append(name)
    facts = {(name, relation): rng.choice(by_kind[value_kind])
             for name, kind in kinds.items() for relation, value_kind in KINDS[kind][1]}
    return kinds, facts


def _fresh_name(rng: random.Random, kind: str, used: set[str]) -> str:
    while True:
        words = [_word(rng, kind) for _ in range(2 if kind == "person" else 1)]
        name = " ".join(words)
        if not any(w.lower() in used for w in words) and name.lower() not in used:
            used.update(w.lower() for w in words if kind != "person")
            used.add(name.lower())
            return name


def _word(rng: random.Random, kind: str) -> str:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 2)))
    word += rng.choice(_SUFFIX[kind]) if kind in _SUFFIX else rng.choice(_CODAS)
    return word.capitalize()


@functools.lru_cache(maxsize=8)
def build_corpus(world_seed: int, docs: int) -> BM25:
    """One document per entity: what it is, its facts and the facts naming it, indexed."""
    kinds, facts = build_world(world_seed, docs)
    sentences = {name: [] for name in kinds}
    for (name, relation), value in facts.items():
        sentences[name].append(f"The {relation} of {name} is {value}.")
        sentences[value].append(f"{value} is the {relation} of {name}.")
    rng = random.Random(f"search-corpus-{world_seed}")
    names = list(kinds)
    rng.shuffle(names)  # doc ids say nothing about the kind
    documents = []
    for number, name in enumerate(names, 1):
        rng.shuffle(sentences[name])
        text = " ".join([f"{name} is a {kinds[name]}.", *sentences[name]])
        documents.append(Document(f"doc-{number}", name, text))
    return BM25(documents)


def question(entity: str, relations: tuple[str, ...]) -> str:
    """"What is the r2 of the r1 of E?" for ``relations`` (r1, r2) in the order followed."""
    return "What is " + " of ".join(f"the {r}" for r in reversed(relations)) + f" of {entity}?"


def parse_question(text: str) -> tuple[str, list[str]]:
    """(entity, relations in the order to follow) of a ``question``."""
    body = re.search(r"What is (.+) of ([^?]+)\?", text)
    if body is None:
        raise ValueError(f"not a search question: {text[:80]!r}")
    relations = [r.removeprefix("the ") for r in body.group(1).split(" of ")]
    return body.group(2), relations[::-1]


@functools.lru_cache(maxsize=16)
def all_questions(world_seed: int, docs: int, hops: int) -> tuple[Task, ...]:
    """Every ``hops``-fact question of the world whose answer is not its own entity."""
    kinds, facts = build_world(world_seed, docs)
    chains = [(name, (), name) for name in kinds]
    for _ in range(hops):
        chains = [(start, (*path, relation), facts[(end, relation)])
                  for start, path, end in chains
                  for relation, _ in KINDS[kinds[end]][1]]
    return tuple(Task(question(start, path), end) for start, path, end in chains if end != start)


def held_out(text: str, fraction: float) -> bool:
    """Whether a question is in the eval split, by a stable hash of its text."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def normalize(text: str) -> str:
    words = " ".join(str(text).lower().strip().strip(".!\"'`*").split())
    return words.removeprefix("the ")


def answer_match(reply: str, answer: str) -> float:
    """1.0 when the reply's final answer (``final_answer``; else the whole reply) is
    ``answer``, ignoring case, spaces, end punctuation and a leading "the"."""
    found = final_answer(reply)
    return 1.0 if normalize(reply if found is None else found) == normalize(answer) else 0.0


class SearchEnv(ToolEnv):
    """A ``ToolEnv`` over one world's questions, with its searching reference player."""

    def __init__(self, train: list[Task], held: list[Task], index: BM25, split: str,
                 top_k: int, max_turns: int):
        self.questions = train if split == "train" else held
        self.split = split
        self.eval_options = {"split": "eval"}  # what held-out evaluation builds (contract.py)
        super().__init__(self.task_for, search_tools(index, top_k), answer_match,
                         instructions=INSTRUCTIONS, max_turns=max_turns)

    def task_for(self, seed: int) -> Task:
        """Training: epoch ``seed // n`` is its own shuffle of the questions; eval: in order."""
        if self.split == "eval":
            return self.questions[seed % len(self.questions)]
        epoch, index = divmod(seed, len(self.questions))
        order = list(range(len(self.questions)))
        random.Random(f"search-epoch-{epoch}").shuffle(order)
        return self.questions[order[index]]

    def reference_player(self) -> Searcher:
        return Searcher(self.fmt)


@register_env("search")
def search_env(hops: int = 2, docs: int = 80, top_k: int = 3, world_seed: int = 0,
               split: str = "train", eval_fraction: float = 0.2, max_turns: int = 0
               ) -> SearchEnv:
    """Multi-hop questions over a generated corpus with search/open tools; reward 1 for the
    exact answer. ``max_turns`` 0: two per hop and one to answer."""
    if hops not in (1, 2, 3):
        raise ValueError(f"search hops must be 1, 2 or 3, got {hops}")
    if docs < 20:
        raise ValueError(f"search docs must be >= 20 (a world needs a few of each kind), "
                         f"got {docs}")
    check_split("search", split, eval_fraction)
    questions = all_questions(world_seed, docs, hops)
    held = [t for t in questions if held_out(t.prompt, eval_fraction)]
    train = [t for t in questions if not held_out(t.prompt, eval_fraction)]
    if not held or not train:
        raise ValueError(f"search: the {split} split of {len(questions)} questions is empty; "
                         "raise docs or change eval_fraction")
    return SearchEnv(train, held, build_corpus(world_seed, docs), split, top_k,
                     max_turns or 2 * hops + 1)


def tool_contents(observation: str) -> str:
    """The text of every tool result in an observation, one after another."""
    texts = []
    for block in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", observation, re.S):
        body = json.loads(block)
        texts.append(str(body.get("content", body.get("error", ""))))
    return "\n".join(texts)


def find_fact(text: str, entity: str, relation: str) -> str | None:
    """The value of ``relation`` of ``entity`` if ``text`` states it (either way round)."""
    name = re.escape(entity)
    forward = re.search(rf"The {re.escape(relation)} of {name} is ([^.|\n]+)\.", text)
    if forward:
        return forward.group(1).strip()
    backward = re.search(rf"([^.|\n]+?) is the {re.escape(relation)} of {name}\.", text)
    return backward.group(1).strip() if backward else None


class Searcher:
    """The reference player: per hop, search "RELATION of ENTITY"; read the fact off a
    snippet, else open the entity's document (the first hit when none is titled so)."""

    def __init__(self, fmt: str = "hermes"):
        self.fmt = fmt

    def reset(self, first_observation: str) -> None:
        self.entity, self.relations = parse_question(first_observation)
        self.pending = ""

    def act(self, observation: str) -> str:
        if self.pending:
            text = tool_contents(observation)
            value = find_fact(text, self.entity, self.relations[0])
            if value is None and self.pending == "search":
                return self._open(text)
            if value is None:
                return "Answer: unknown"
            self.entity, self.relations = value, self.relations[1:]
            if not self.relations:
                return f"Answer: {self.entity}"
        self.pending = "search"
        query = f"{self.relations[0]} of {self.entity}"
        return render_call("search", {"query": query}, self.fmt)

    def _open(self, hits: str) -> str:
        rows = [line.split(" | ") for line in hits.splitlines() if line.count(" | ") >= 2]
        titled = [row[0] for row in rows if row[1] == self.entity]
        self.pending = "open"
        doc_id = (titled or [row[0] for row in rows] or ["doc-1"])[0]
        return render_call("open", {"doc_id": doc_id}, self.fmt)
