"""Frozen opponents batch the moves that games ask for at the same time (turnrl/selfplay/
opponents.py ``FrozenPolicy``, turnrl/selfplay/batched_calls.py), each game on its own random stream
(``HFEngine.generate``'s ``generators``): what a game's opponent plays does not depend on
which games shared its batch, nor (``opponent: model``) on which games ran beside it
(docs/selfplay.md)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from tests.conftest import MovesEngine
from turnrl.envs import StepResult, make_env, register_env
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import HFEngine, SamplingParams
from turnrl.selfplay.batched_calls import BatchedCalls, BatchError
from turnrl.selfplay.opponents import FrozenPolicy, ModelOpponent, PoolPlayer
from turnrl.selfplay.pool import OpponentPool


def _streams(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def _prompts(chat, count):
    """Distinct prompts of different lengths, and one repeated (shared in a batch)."""
    prompts = [chat.start(f"Game {i}: {'x' * (3 * i)} your move?", "Play.")[2]
               for i in range(count)]
    prompts[-1] = prompts[1]
    return prompts


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},  # plain sampling: the CDF is inverted
    {"temperature": 1.0, "top_p": 0.9},  # torch.multinomial
    {"temperature": 0.7, "stop_every": 3},  # rows stop at different steps (compaction)
], ids=["plain", "top_p", "early_stops"])
def test_each_row_samples_on_its_own_stream_whatever_shares_its_call(tiny, params):
    model, tok = tiny
    chat = ChatFormat(tok)
    stop_every = params.pop("stop_every", 0)
    stops = tuple(range(0, len(tok), stop_every)) if stop_every else ()
    sampling = SamplingParams(10, stop_token_ids=stops, **params)
    engine = HFEngine(model, tok.pad_token_id, seed=5, reuse_cache=False)
    prompts = _prompts(chat, 7)
    seeds = [100 + i for i in range(len(prompts))]
    alone = [engine.generate([p], sampling, generators=_streams([s]))[0].token_ids
             for p, s in zip(prompts, seeds, strict=True)]
    batched = engine.generate(prompts, sampling, generators=_streams(seeds))
    assert [c.token_ids for c in batched] == alone
    reordered = engine.generate(prompts[::-1], sampling, generators=_streams(seeds[::-1]))
    assert [c.token_ids for c in reordered][::-1] == alone
    if stop_every:
        assert len({len(tokens) for tokens in alone}) > 1  # the rows did stop apart
    # the check can fail: one stream for the whole batch gives other tokens
    shared = engine.generate(prompts, sampling)
    assert [c.token_ids for c in shared] != alone
    # a row without a stream of its own draws on the engine's; the others are unmoved
    mixed = engine.generate(prompts[:3], sampling, generators=[None, *_streams(seeds[1:3])])
    assert [c.token_ids for c in mixed[1:]] == alone[1:3]


def test_a_wrong_number_of_generators_is_refused_in_one_line(tiny):
    model, tok = tiny
    engine = HFEngine(model, tok.pad_token_id)
    with pytest.raises(ValueError, match="2 generators for 3 prompts"):
        engine.generate([[1, 2], [3], [4]], SamplingParams(2), generators=_streams([1, 2]))


def _pool(tiny, seed=0):
    model, tok = tiny
    chat = ChatFormat(tok)
    pool = OpponentPool(chat, SamplingParams(6, 1.0, stop_token_ids=(chat.end_of_turn,)),
                        size=1, every=1, seed=seed)
    pool.offer(0, model)
    return pool


def _play_together(players, observations, rounds):
    """Each player's replies to its observation, ``rounds`` moves, all players' moves of a
    round asked for at once (one thread a game); their threads are joined."""
    replies = [[] for _ in players]
    start = threading.Barrier(len(players))

    def game(i):
        for turn in range(rounds):
            start.wait(timeout=60)
            replies[i].append(players[i].act("Play.", f"{observations[i]} turn {turn}"))
    threads = [threading.Thread(target=game, args=(i,)) for i in range(len(players))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return replies


def test_concurrent_moves_go_in_one_batch_and_each_game_plays_as_it_would_alone(tiny):
    member = _pool(tiny).members[0]
    games, rounds = 6, 3
    observations = [f"Game {i}: {'o' * (2 * i)}" for i in range(games)]
    seeds = [7 + 31 * i for i in range(games)]
    alone = []
    for obs, seed in zip(observations, seeds, strict=True):
        player = PoolPlayer(member, seed)  # one game: its moves, one after another
        alone.append([player.act("Play.", f"{obs} turn {t}") for t in range(rounds)])
    assert all(size == 1 for size in member.moves.batch_sizes)
    member.moves.batch_sizes.clear()
    member.moves.window_s = 5.0  # a whole round waits for its last game (a busy machine)
    member.moves.max_batch = games  # ... and no longer: a full batch goes at once
    threads_before = set(threading.enumerate())
    together = _play_together([PoolPlayer(member, seed) for seed in seeds], observations,
                              rounds)
    assert list(member.moves.batch_sizes) == [games] * rounds
    assert together == alone
    assert len({reply for replies in alone for reply in replies}) > games  # not all alike
    # no thread of its own: the callers ran the batches
    assert set(threading.enumerate()) == threads_before


def test_a_failing_batch_fails_each_of_its_moves_with_the_reason_and_the_next_works(tiny):
    member = _pool(tiny).members[0]
    member.moves.window_s, member.moves.max_batch = 5.0, 3
    chat = member.chat
    good = [chat.start(f"Game {i}", "Play.")[2] for i in range(2)]
    broken = [len(chat.tokenizer) + 50]  # no such token: the embedding lookup raises
    errors: list[BaseException] = []

    def ask(ids, seed):
        try:
            member.moves.call((ids, torch.Generator().manual_seed(seed)))
        except BatchError as err:
            errors.append(err)
    threads = [threading.Thread(target=ask, args=(ids, i))
               for i, ids in enumerate([good[0], broken, good[1]])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert list(member.moves.batch_sizes) == [3] and len(errors) == 3
    for err in errors:
        assert "opponent pool-v0: a batch of 3 failed: IndexError" in str(err)
        assert isinstance(err.__cause__, IndexError)
    # the next batch works, and samples what the game would have alone
    member.moves.window_s = 0.0
    again = member.moves.call((good[0], torch.Generator().manual_seed(0)))
    alone = member.engine.generate([good[0]], member.params, generators=_streams([0]))[0]
    assert again.token_ids == alone.token_ids and list(member.moves.batch_sizes) == [3, 1]


@pytest.mark.parametrize("failure, raised", [
    (lambda items: [x * 2 for x in items][:-1], "RuntimeError: 2 answers for 3 calls"),
    (lambda items: 1 / 0 if 2 in items else items, "ZeroDivisionError: division by zero"),
], ids=["too_few_answers", "raises"])
def test_any_failure_of_a_batch_reaches_each_of_its_callers(failure, raised):
    calls = BatchedCalls(failure, name="test", window_s=5.0, max_batch=3)
    outcomes: dict[int, str] = {}

    def ask(item):
        try:
            outcomes[item] = calls.call(item)
        except BatchError as err:
            outcomes[item] = str(err)
    threads = [threading.Thread(target=ask, args=(item,)) for item in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert list(calls.batch_sizes) == [3]
    assert all(outcomes[i] == f"test: a batch of 3 failed: {raised}" for i in (1, 2, 3))


def test_calls_past_max_batch_wait_for_the_next_batch_and_each_gets_its_own_answer():
    calls = BatchedCalls(lambda items: [10 * x for x in items], name="test", window_s=0.5,
                         max_batch=2)
    answers: dict[int, int] = {}
    start = threading.Barrier(5)

    def ask(item):
        start.wait(timeout=60)
        answers[item] = calls.call(item)
    threads = [threading.Thread(target=ask, args=(item,)) for item in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == {item: 10 * item for item in range(5)}
    assert sum(calls.batch_sizes) == 5 and max(calls.batch_sizes) == 2


def test_an_interrupt_in_a_batch_stops_its_leader_fails_the_others_and_the_next_works():
    def run(items):
        if "stop" in items:
            raise KeyboardInterrupt
        return [item.upper() for item in items]
    calls = BatchedCalls(run, name="test", window_s=5.0, max_batch=2)
    outcomes: dict[str, BaseException] = {}

    def ask(item):
        try:
            calls.call(item)
        except BaseException as err:  # noqa: BLE001 - what each caller got
            outcomes[item] = err
    threads = [threading.Thread(target=ask, args=(item,)) for item in ("stop", "go")]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # "stop" leads
    for thread in threads:
        thread.join(timeout=60)
    assert isinstance(outcomes["stop"], KeyboardInterrupt)
    assert isinstance(outcomes["go"], BatchError) and "KeyboardInterrupt" in str(outcomes["go"])
    calls.window_s = 0.0
    assert calls.call("next") == "NEXT"


def test_bad_batch_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="max_batch >= 1"):
        BatchedCalls(list, max_batch=0)
    with pytest.raises(ValueError, match="window_s >= 0"):
        BatchedCalls(list, window_s=-1.0)


@register_env("test-answered")
class Answered:
    """One seat against an outside player (``set_opponent``): each reply of the policy is
    answered by the opponent, ``moves`` times; the last step's info lists its answers."""

    def __init__(self, moves: int = 3):
        self.moves, self.player, self.seed, self.answers = moves, None, 0, []

    def set_opponent(self, player):
        self.player = player

    async def reset(self, seed):
        self.seed, self.answers = seed, []
        return "Say something."

    async def step(self, action):  # blocks on the opponent, on this env's own thread
        view = f"Game {self.seed} ({'.' * self.seed}), move {len(self.answers)}: {action}"
        self.answers.append(self.player.act("Answer.", view))
        done = len(self.answers) == self.moves
        return StepResult("Go on.", 0.0, done, {"answers": list(self.answers)} if done else {})


def _rollout(pool, games, env_timeout_s=30.0):
    chat = pool.chat
    return run_sync(run_episodes(
        pool.attach(partial(make_env, "test-answered")), [(s, s) for s in range(games)],
        MovesEngine(chat.tokenizer, ["hi", "so", "ok"]), chat,
        SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)), env_name="test-answered",
        env_timeout_s=env_timeout_s))


def test_a_rollout_against_the_pool_batches_its_moves_and_plays_the_same_games(tiny):
    games = 8
    one_at_a_time, batched = _pool(tiny, seed=3), _pool(tiny, seed=3)
    one_at_a_time.members[0].moves.max_batch = 1  # as before batching: under a lock
    batched.members[0].moves.window_s = 0.2  # a busy machine's env threads arrive far apart
    reference, played = _rollout(one_at_a_time, games), _rollout(batched, games)
    assert all(ep.status == "done" for ep in reference + played)
    assert set(one_at_a_time.members[0].moves.batch_sizes) == {1}
    sizes = batched.members[0].moves.batch_sizes
    assert sum(sizes) == 3 * games and max(sizes) > 1
    assert [ep.info["answers"] for ep in played] == [ep.info["answers"] for ep in reference]


def test_games_that_time_out_in_a_batch_do_not_wedge_the_later_ones(tiny):
    pool = _pool(tiny)
    moves = pool.members[0].moves
    generate, stalled = moves.run, threading.Event()

    def stalls_once(items):  # a generation far slower than the env's timeout, once
        if not stalled.is_set():
            stalled.set()
            time.sleep(3.0)
        return generate(items)
    moves.run = stalls_once
    threads_before = set(threading.enumerate())
    timed_out = _rollout(pool, 4, env_timeout_s=1.0)
    assert {ep.status for ep in timed_out} == {"timeout"}
    # the abandoned games' moves are still being generated: the next games wait for that
    # batch, then are answered
    after = _rollout(pool, 4, env_timeout_s=30.0)
    assert {ep.status for ep in after} == {"done"}
    assert all(len(ep.info["answers"]) == 3 for ep in after)
    deadline = time.monotonic() + 30
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.1)  # the abandoned env threads end once their calls return
    assert not set(threading.enumerate()) - threads_before


def _model_answers(opponent, seeds):
    """The opponent's answers in each game of one rollout of ``test-answered`` (env seeds
    ``seeds``, in that order), the policy's moves scripted."""
    chat = opponent.player.chat
    played = run_sync(run_episodes(
        opponent.attach(partial(make_env, "test-answered")),
        [(seed, i) for i, seed in enumerate(seeds)], MovesEngine(chat.tokenizer, ["hi", "so"]),
        chat, SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,)),
        env_name="test-answered"))
    assert all(ep.status == "done" for ep in played)
    return [ep.info["answers"] for ep in played]


def test_a_model_opponent_plays_each_game_on_its_own_stream_whatever_runs_beside_it(tiny):
    model, tok = tiny
    chat = ChatFormat(tok)
    params = SamplingParams(6, 1.0, stop_token_ids=(chat.end_of_turn,))
    player = FrozenPolicy(model, chat, params, 0, 5, label="model:tiny")
    opponent = ModelOpponent(player, seed=5)
    alone = _model_answers(opponent, [4])[0]
    beside = _model_answers(opponent, [1, 4, 2, 4, 3])  # seed 4 twice: one group's games
    assert beside[1] == alone == beside[3]
    assert _model_answers(opponent, [4])[0] == alone  # the model's own stream is not used
    assert len({tuple(answers) for answers in beside}) == 4  # the other seeds play otherwise
    assert len(set(alone)) > 1  # each move draws on
    assert _model_answers(ModelOpponent(player, seed=6), [4])[0] != alone  # run.seed counts
    with pytest.raises(RuntimeError, match="before its game started"):
        opponent.sample().act("Answer.", "no reset")
