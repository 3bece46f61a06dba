"""The multi-turn task suite: solvable by the scripted players, hard for random ones,
deterministic, with state keys that name the true state, and lenient but strict parsing."""

import asyncio
import random

import pytest

from turnrl.envs import ENVS, make_env
from turnrl.envs.maze import MOVES, distances, parse_direction
from turnrl.envs.reference import REFERENCE_POLICIES, play
from turnrl.envs.twenty_questions import load_objects
from turnrl.envs.wordle import feedback, load_words, show

CASES = [
    ("guess-number", {}),
    ("guess-number", {"high": 100, "max_turns": 8}),
    ("twenty-questions", {"num_objects": 8}),
    ("twenty-questions", {}),
    ("twenty-questions", {"num_objects": 32}),
    ("maze", {"size": 3}),
    ("maze", {"size": 5}),
    ("wordle", {}),
    ("wordle", {"word_length": 3, "num_words": 60}),
    ("wordle", {"word_length": 5, "num_words": 70}),
]
SEEDS = range(30)


def run(coro):
    return asyncio.run(coro)


def steps(env, seed, actions):
    """Reset, then apply ``actions``; return the StepResults."""

    async def go():
        await env.reset(seed)
        return [await env.step(a) for a in actions]

    return run(go())


class RandomPolicy:
    """Seeded uniform choice among well-formed actions."""

    def __init__(self, actions, seed):
        self.actions, self.rng = actions, random.Random(f"random-{seed}")

    def reset(self, first_observation):
        pass

    def act(self, observation):
        return self.rng.choice(self.actions)


def valid_actions(name, options):
    if name == "guess-number":
        return [str(n) for n in range(1, options.get("high", 10) + 1)]
    if name == "twenty-questions":
        table = load_objects()
        objects = list(table.objects)[:options.get("num_objects", 16)]
        return [f"{a}?" for a in table.attributes] + [f"guess: {o}" for o in objects]
    if name == "maze":
        return list(MOVES)
    return load_words()[options.get("word_length", 4)][:options.get("num_words", 40)]


@pytest.mark.parametrize(("name", "options"), CASES)
def test_scripted_policy_always_wins_and_random_does_much_worse(name, options):
    ref, rnd = [], []
    for seed in SEEDS:
        ref.append(run(play(make_env(name, **options), REFERENCE_POLICIES[name](), seed)))
        rnd.append(run(play(make_env(name, **options),
                            RandomPolicy(valid_actions(name, options), seed), seed)))
    assert all(success for _, success, _ in ref)
    assert all(0.0 < reward <= 1.0 for reward, _, _ in ref)
    assert sum(success for _, success, _ in rnd) / len(SEEDS) < 0.5
    assert all(0.0 <= reward <= 1.0 for reward, _, _ in rnd)
    # outcome reward only: a failed episode pays nothing, a faster win pays more
    assert all(reward == 0.0 for reward, success, _ in rnd if not success)
    fastest = min(ref, key=lambda r: r[2])
    slowest = max(ref, key=lambda r: r[2])
    assert fastest[0] >= slowest[0]


@pytest.mark.parametrize("name", list(REFERENCE_POLICIES))
def test_registered_with_docs_and_system_prompt(name):
    assert name in ENVS
    env = make_env(name)
    assert isinstance(env.system_prompt, str) and env.system_prompt
    doc = ENVS[name].__doc__.strip().splitlines()[0]
    assert doc.startswith("Multi-turn:")
    if name != "guess-number":
        assert "arXiv:2311.18232" in ENVS[name].__doc__


@pytest.mark.parametrize(("name", "options"), CASES[::2])
def test_deterministic_under_seed(name, options):
    def transcript(seed):
        lines = []
        run(play(make_env(name, **options), REFERENCE_POLICIES[name](), seed, lines))
        return lines

    assert transcript(3) == transcript(3)
    assert len({str(transcript(seed)) for seed in range(8)}) > 1


def test_data_files_load_and_tell_objects_apart():
    table = load_objects()
    assert len(table.objects) >= 16 and len(table.attributes) >= 8
    assert len(set(table.objects.values())) == len(table.objects)
    words = load_words()
    assert {3, 4, 5} <= words.keys() and all(len(words[n]) >= 40 for n in (3, 4, 5))
    assert all(len(w) == n for n, ws in words.items() for w in ws)


def test_wordle_feedback_follows_repeated_letter_rules():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("geese", "eerie") == "_GY_G"  # only one e left over for yellow
    assert feedback("speed", "abide") == "__Y_Y"
    assert feedback("allee", "lalal") == "YYG__"
    assert feedback("book", "boot") == "GGG_"
    assert feedback("odd", "add") == "_GG"


def test_wordle_observations_and_invalid_guesses():
    env = make_env("wordle", word_length=4, num_words=40)
    first = run(env.reset(0))
    assert first == "Guess my 4-letter word (one of 40) in 6 tries."
    target = env.target
    other = next(w for w in load_words()[4] if w != target)
    bad, short, unknown, good = steps(env, 0, ["???", "cat", "abcd", f"My guess: {other.upper()}!"])
    assert bad.observation == short.observation == "Use a 4-letter word."
    assert unknown.observation == "Not in my word list."
    assert [r.info["state_key"] for r in (bad, short, unknown)] == ["none"] * 3
    assert good.observation == show(other, feedback(other, target))
    win = steps(env, 0, [target])[0]
    assert win.done and win.info["success"] and win.reward == 1.0


def test_wordle_state_key_is_the_set_of_patterns():
    env = make_env("wordle")
    run(env.reset(5))
    a, b = [w for w in load_words()[4] if w != env.target][:2]
    ab = steps(env, 5, [a, b])[-1].info["state_key"]
    ba = steps(env, 5, [b, a])[-1].info["state_key"]
    aab = steps(env, 5, [a, a, b])[-1].info["state_key"]
    assert ab == ba == aab and ab != steps(env, 5, [a])[-1].info["state_key"]


def test_twenty_questions_parsing_answers_and_state_keys():
    env = make_env("twenty-questions", num_objects=16)
    first = run(env.reset(1))
    assert first.startswith("I am thinking of one of: cat, apple, car,")
    target = env.target
    facts = load_objects().objects[target]
    ask = steps(env, 1, ["Is it an ANIMAL?", "Can it fly", "bigger than a breadbox?"])
    assert [r.observation for r in ask] == [
        "Yes." if a in facts else "No." for a in ("animal", "flies", "big")]
    assert ask[-1].info["state_key"] == ",".join(
        f"{a}={'y' if a in facts else 'n'}" for a in ("animal", "big", "flies"))
    reordered = steps(env, 1, ["big?", "flies?", "animal?", "animal?"])
    assert reordered[-1].info["state_key"] == ask[-1].info["state_key"]
    wrong = next(o for o in env.candidates if o != target)
    bad = steps(env, 1, ["hmm", "animal and plant?", "guess: unicorn", f"Guess: {wrong}."])
    assert all(r.observation.startswith("I don't understand") for r in bad[:3])
    assert [r.info["state_key"] for r in bad] == ["none"] * 3 + [f"{wrong}=n"]
    assert bad[-1].observation == f"No, not {wrong}." and not bad[-1].done
    win = steps(env, 1, [f"Is it a {target}?"])[0]
    assert win.done and win.info["success"] and win.reward == 1.0
    slow = steps(env, 1, ["animal?", "big?", target])[-1]
    assert slow.reward == pytest.approx(1.0 - 2 * 0.02)
    lost = steps(env, 1, ["hmm"] * 10)
    assert lost[-1].done and not lost[-1].info["success"] and lost[-1].reward == 0.0
    with pytest.raises(ValueError, match="bad env.options"):
        make_env("twenty-questions", num_objects=1000, colour=1)
    with pytest.raises(ValueError, match="num_objects"):
        make_env("twenty-questions", num_objects=1000)


def test_maze_is_solvable_and_observations_match_walls():
    for size in (2, 3, 4, 6):
        env = make_env("maze", size=size)
        for seed in range(10):
            first = run(env.reset(seed))
            assert first.startswith(f"Find the goal in {2 * (size * size - 1)} moves. open: ")
            dist = distances(env.opened, env.pos)
            assert len(dist) == size * size and env.goal in dist and env.goal != env.pos
            assert sum(map(len, env.opened.values())) == 2 * (size * size - 1)  # a tree


def test_maze_moves_walls_and_state_keys():
    env = make_env("maze", size=4)
    run(env.reset(2))
    start = env.state_key
    open_dirs = [d for d in MOVES if d in env.opened[env.pos]]
    walls = [d for d in MOVES if d not in env.opened[env.pos]]
    back = {"north": "south", "south": "north", "east": "west", "west": "east"}
    go = open_dirs[0]
    there, again = steps(env, 2, [f"Go {go.upper()}!", back[go]])
    assert there.info["state_key"] != start and again.info["state_key"] == start
    assert steps(env, 2, [go[0]])[0].info["state_key"] == there.info["state_key"]
    assert again.observation == first_view(env, 2)
    if walls:
        hit = steps(env, 2, [walls[0]])[0]
        assert hit.observation.startswith("Wall. open: ") and hit.info["state_key"] == start
    junk = steps(env, 2, ["let's think", "north or south"])
    assert all(r.observation.startswith("Say north, south, east or west.") for r in junk)
    assert parse_direction("n") == "north" and parse_direction("let's go") is None


def first_view(env, seed):
    return run(env.reset(seed)).split(". ", 1)[1]


def test_maze_shows_the_goal_one_step_away():
    for seed in range(5):
        transcript = []
        run(play(make_env("maze", size=3), REFERENCE_POLICIES["maze"](), seed, transcript))
        (last_seen, last_move), earlier = transcript[-1], transcript[:-1]
        assert last_seen.endswith(f". goal: {last_move}")
        assert not any("goal" in seen.split(". ", 1)[-1] for seen, _ in earlier)


def test_guess_number_state_key_is_the_feasible_interval():
    env = make_env("guess-number", high=100, max_turns=8)
    run(env.reset(7))
    t = env.target
    assert 5 < t < 95
    ab = steps(env, 7, [str(t - 5), str(t + 5)])[-1].info["state_key"]
    ba = steps(env, 7, [str(t + 5), "no idea", "0", str(t - 5)])[-1].info["state_key"]
    assert ab == ba == f"{t - 4}..{t + 4}"
    assert steps(env, 7, ["what?"])[0].info["state_key"] == "1..100"
    assert steps(env, 7, [str(t)])[0].info["state_key"] == f"{t}..{t}"
