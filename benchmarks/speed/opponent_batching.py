"""Frozen opponents: N games' moves batched vs one at a time, side by side in one run.

N games, each on a thread of its own as env threads are and with its own sampling stream (a
``PoolPlayer``), ask one pool member for a move at the same moment (a barrier); a round's
time runs from then to the last reply. Each repeat plays a round one at a time
(``max_batch`` 1: the lock the moves used to queue on) and a round batched (the default:
``BatchedCalls``), in alternating order, on the same member; the medians, their ratio and the
mean batch size are printed per N. The replies of the two rounds are checked equal (each game
samples on its own stream, whatever shares its batch). The rounds, ratios, machine line and
the last line, ``ratio: one at a time / batched at N games = X`` (the largest N, the last
table), are the shared harness's (``benchmarks/harness.py``).

``--rollout`` adds the same through the turn loop: N TicTacToe games against the pool
(``run_episodes``, one env thread a game), the policy's moves fixed ("5"), so the time is the
env threads' and the opponent's; the tiny random model's reply is seldom a legal move, so
most games end at the opponent's first move (one move a game).

    python benchmarks/speed/opponent_batching.py --games 1 8 32 --repeats 10
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from turnrl.envs import make_env
from turnrl.envs.tictactoe import seat_view
from turnrl.models import configure_torch, tiny_model
from turnrl.rollout import ChatFormat, run_episodes, run_sync
from turnrl.samplers import Completion, SamplingParams
from turnrl.selfplay.opponents import PoolPlayer
from turnrl.selfplay.pool import OpponentPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness
import harness  # noqa: E402

MODES = ("batched", "one_at_a_time")


def boards(count: int, seed: int = 0) -> list[str]:
    """Mid-game TicTacToe positions, as an opponent is shown them."""
    rng = random.Random(seed)
    views = []
    for _ in range(count):
        cells = rng.sample(range(9), rng.randint(1, 6))
        board = ["."] * 9
        for k, cell in enumerate(cells):
            board[cell] = "XO"[k % 2]
        views.append(seat_view("".join(board), "XO"[len(cells) % 2]))
    return views


def one_round(players: list[PoolPlayer], views: list[str], system: str
              ) -> tuple[float, list[str]]:
    """Every game asks for its move at once: (seconds to the last reply, the replies)."""
    replies: list[str] = [""] * len(players)
    start = threading.Barrier(len(players) + 1)

    def game(i: int) -> None:
        start.wait()
        replies[i] = players[i].act(system, views[i])
    threads = [threading.Thread(target=game, args=(i,)) for i in range(len(players))]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, replies


def alternate_modes(member, repeats: int, play: Callable[[str, int], object]
                    ) -> tuple[harness.Rounds, list[int]]:
    """``play(mode, repeat)`` for both modes in alternating rounds (batched first in even
    ones), on ``member`` set to batch its moves or not; the rounds and the batched sizes."""
    sizes: list[int] = []

    def mode_call(mode: str):
        repeats_done = iter(range(repeats))

        def run():
            member.moves.max_batch = 1 if mode == "one_at_a_time" else 64
            member.moves.batch_sizes.clear()
            result = play(mode, next(repeats_done))
            if mode == "batched":
                sizes.extend(member.moves.batch_sizes)
            return result
        return run

    rounds = harness.alternate({mode: mode_call(mode) for mode in MODES}, repeats, warmup=0,
                               flip=True)
    return rounds, sizes


def row(games: int, alone: list[float], batched: list[float], sizes: list[int]) -> dict:
    """A table row: the medians of both modes' seconds, their ratio, the mean batch size."""
    return {"games": games, "one_at_a_time_ms": 1e3 * statistics.median(alone),
            "batched_ms": 1e3 * statistics.median(batched),
            "ratio": harness.ratio_of_medians(alone, batched),
            "mean_batch": statistics.mean(sizes)}


def compare(member, games: int, repeats: int, system: str) -> dict:
    """Medians of ``repeats`` rounds of ``games`` moves, one at a time and batched."""
    views = boards(games, seed=games)

    def play(mode: str, repeat: int) -> tuple[float, list[str]]:
        players = [PoolPlayer(member, 1000 * repeat + i) for i in range(games)]
        return one_round(players, views, system)  # timed from the barrier to the last reply

    rounds, sizes = alternate_modes(member, repeats, play)
    alone, batched = rounds.results["one_at_a_time"], rounds.results["batched"]
    for repeat, (one, both) in enumerate(zip(alone, batched, strict=True)):
        if one[1] != both[1]:
            raise AssertionError(f"{games} games, repeat {repeat}: replies differ batched")
    return row(games, [took for took, _ in alone], [took for took, _ in batched], sizes)


class FixedMoves:
    """The policy's side of a rollout: every row replies "5" (no model time)."""

    version = 0

    def __init__(self, chat: ChatFormat) -> None:
        self.ids = [*chat.tokenizer("5", add_special_tokens=False)["input_ids"], chat.end_of_turn]

    def generate(self, prompts, params) -> list[Completion]:
        return [Completion(list(self.ids), [-0.5] * len(self.ids), "stop") for _ in prompts]


def compare_rollouts(pool: OpponentPool, games: int, repeats: int) -> dict:
    """Medians of ``repeats`` rollouts of ``games`` TicTacToe games against the pool."""
    member, chat = pool.members[0], pool.chat
    make = pool.attach(partial(make_env, "tictactoe", opponent="pool", role="x"))
    params = SamplingParams(4, 1.0, stop_token_ids=(chat.end_of_turn,))

    def play(mode: str, repeat: int) -> None:
        run_sync(run_episodes(make, [(s, s) for s in range(games)], FixedMoves(chat), chat,
                              params, env_name="tictactoe"))

    rounds, sizes = alternate_modes(member, repeats, play)
    return row(games, rounds.wall["one_at_a_time"], rounds.wall["batched"], sizes)


def print_row(row: dict) -> None:
    print(f"{row['games']:>5} {row['one_at_a_time_ms']:>16.1f} {row['batched_ms']:>10.1f} "
          f"{row['ratio']:>6.2f} {row['mean_batch']:>10.1f}", flush=True)


HEADER = f"{'games':>5} {'one at a time ms':>16} {'batched ms':>10} {'ratio':>6} {'mean batch':>10}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rollout", action="store_true",
                        help="also time TicTacToe rollouts against the pool (turn loop)")
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    model, tokenizer = tiny_model(seed=0)
    chat = ChatFormat(tokenizer)
    pool = OpponentPool(chat, SamplingParams(args.max_new_tokens, 1.0,
                                             stop_token_ids=(chat.end_of_turn,)),
                        size=1, every=1)
    pool.offer(0, model)
    member = pool.members[0]
    system = "You are playing TicTacToe. Reply with the number of a free cell (1-9)."
    load = harness.load_average()
    print(f"# tiny model, {args.max_new_tokens} new tokens at most, torch {torch.__version__},"
          f" {args.threads} torch threads; medians of {args.repeats} alternating rounds each "
          "(replies checked equal both ways)")
    print(f"# one move per game, a thread each\n{HEADER}")
    for games in args.games:
        last = compare(member, games, args.repeats, system)
        print_row(last)
    if args.rollout:
        print(f"# TicTacToe rollouts against the pool (turn loop, env threads)\n{HEADER}")
        for games in args.games:
            last = compare_rollouts(pool, games, args.repeats)
            print_row(last)
    print(harness.machine(load))
    print(harness.ratio_line(f"one at a time / batched at {last['games']} games",
                             last["ratio"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
