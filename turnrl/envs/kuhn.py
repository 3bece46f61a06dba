"""Kuhn Poker against a fixed opponent, and the exact exploitability of any strategy.

Kuhn 1950, "A simplified two-person poker": three cards (J < Q < K), one dealt to each
player, each antes 1. The first player checks or bets 1; facing a check the second player
checks (showdown for 1) or bets; facing a bet a player calls (showdown for 2) or folds. The
game value for the first player under equilibrium play is -1/18.

Histories use ``p`` (check or fold) and ``b`` (bet or call). An information set is a card and
a history where a player acts: the first player at ``""`` and ``"pb"``, the second at ``"p"``
and ``"b"``, 12 in all. A strategy is the probability of ``b`` at each of them.

The env deals from the seed; the policy plays ``role`` first, second, or either by the
seed's parity (``both``). The opponent plays ``nash`` (an equilibrium: the first player's
family with ``alpha`` = 1/6, Kuhn's second-player strategy) or ``random``. Replies are a word:
check, bet, call or fold. An illegal reply loses the most a hand can lose (2 chips), with
the reason in ``info["reason"]``. The reward is the chips won over 2, in [-1, 1];
``info["chips"]`` keeps the chips and ``success`` is a won hand.

More opponents: ``pool`` and ``model`` (an outside player handed over with ``set_opponent``:
the trainer's frozen past policies, or another local model, turnrl/selfplay/; its illegal
reply loses it 2 chips) and
``self``: the policy plays both seats of one hand (``seats`` first and second,
envs/contract.py), one episode per seat, zero-sum (docs/selfplay.md).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping

from turnrl.envs.base import StepResult, register_env

CARDS = "JQK"
INFOSET_HISTORIES = {0: ("", "pb"), 1: ("p", "b")}
"""Where each player (0 first, 1 second) acts."""
TERMINAL = ("pp", "bp", "bb", "pbp", "pbb")
GAME_VALUE = -1 / 18
"""The first player's expected chips under any equilibrium."""

Strategy = Mapping[tuple[str, str], float]
"""(card, history) -> probability of ``b`` (bet or call) at that information set."""


def infosets(player: int) -> list[tuple[str, str]]:
    return [(card, h) for card in CARDS for h in INFOSET_HISTORIES[player]]


def acting(history: str) -> int:
    return len(history) % 2


def payoff(cards: tuple[int, int], history: str) -> int:
    """Chips the first player wins at a terminal history (the second wins the negative)."""
    if history == "bp":
        return 1  # the second player folded
    if history == "pbp":
        return -1  # the first player folded
    stake = 2 if history.endswith("bb") else 1
    return stake if cards[0] > cards[1] else -stake


def expected_value(first: Strategy, second: Strategy) -> float:
    """The first player's expected chips when the first player plays ``first`` and the second
    ``second``, over the six deals."""
    def value(cards: tuple[int, int], history: str) -> float:
        if history in TERMINAL:
            return payoff(cards, history)
        player = acting(history)
        p_bet = (first, second)[player][(CARDS[cards[player]], history)]
        return p_bet * value(cards, history + "b") + (1 - p_bet) * value(cards, history + "p")

    deals = list(itertools.permutations(range(3), 2))
    return sum(value(cards, "") for cards in deals) / len(deals)


def pure_strategies(player: int) -> list[dict[tuple[str, str], float]]:
    """Every deterministic strategy of ``player`` (2^6 = 64)."""
    sets = infosets(player)
    return [dict(zip(sets, map(float, bits), strict=True))
            for bits in itertools.product((0, 1), repeat=len(sets))]


def best_response_values(first: Strategy, second: Strategy) -> tuple[float, float]:
    """(the most the first player can win against ``second``, the most the second can win
    against ``first``), exact: a best response in a finite game is attained by a pure
    strategy, and each player has 64."""
    br_first = max(expected_value(s, second) for s in pure_strategies(0))
    br_second = max(-expected_value(first, s) for s in pure_strategies(1))
    return br_first, br_second


def exploitability(strategy: Strategy) -> float:
    """How much a best responder wins, on average over the two seats, against a player who
    uses ``strategy`` (all 12 information sets) in both seats: ``(br1 + br2) / 2``, with
    ``br1 + br2 = 0`` exactly at an equilibrium (the game value cancels)."""
    br_first, br_second = best_response_values(strategy, strategy)
    return (br_first + br_second) / 2


def nash_strategy(alpha: float = 1 / 6) -> dict[tuple[str, str], float]:
    """An equilibrium (Kuhn 1950): the first player bets J with alpha, never Q, K with
    3 alpha, and after check-bet calls Q with alpha + 1/3 and K always; the second player
    calls a bet with Q 1/3 of the time and K always, and bets after a check with J 1/3 of the
    time and K always."""
    if not 0 <= alpha <= 1 / 3:
        raise ValueError(f"alpha must be in [0, 1/3], got {alpha}")
    return {("J", ""): alpha, ("Q", ""): 0.0, ("K", ""): 3 * alpha,
            ("J", "pb"): 0.0, ("Q", "pb"): alpha + 1 / 3, ("K", "pb"): 1.0,
            ("J", "b"): 0.0, ("Q", "b"): 1 / 3, ("K", "b"): 1.0,
            ("J", "p"): 1 / 3, ("Q", "p"): 0.0, ("K", "p"): 1.0}


UNIFORM = {key: 0.5 for key in infosets(0) + infosets(1)}
ACTION_WORDS = {"": ("check", "bet"), "p": ("check", "bet"), "b": ("fold", "call"),
                "pb": ("fold", "call")}
"""The words for (p, b) at each history."""


def parse_action(text: str, history: str) -> str | None:
    """``p`` or ``b`` from the first legal word in the reply, else None."""
    pass_word, bet_word = ACTION_WORDS[history]
    found = re.search(rf"\b({pass_word}|{bet_word})\b", text.lower())
    if found is None:
        return None
    return "b" if found.group(1) == bet_word else "p"


def observation(seat: int, card: str, history: str) -> str:
    """What the player in ``seat`` (0 first) reads when it acts holding ``card`` after
    ``history``."""
    pass_word, bet_word = ACTION_WORDS[history]
    betting = describe(history)
    return (f"You are player {seat + 1}; your card is {card}. "
            f"{betting + ' ' if betting else ''}Your action ({pass_word} or {bet_word})?")


def conversation(system_prompt: str, card: str, history: str) -> list[dict]:
    """The chat the policy has seen when it acts at ``(card, history)``: the first player's
    second decision follows its own check."""
    seat = 0 if history in INFOSET_HISTORIES[0] else 1
    messages = [{"role": "system", "content": system_prompt}]
    if history == "pb":
        messages += [{"role": "user", "content": observation(0, card, "")},
                     {"role": "assistant", "content": ACTION_WORDS[""][0]}]
    return messages + [{"role": "user", "content": observation(seat, card, history)}]


def describe(history: str) -> str:
    """The betting so far, in words, from the start of the hand."""
    words = {"": [], "p": ["Player 1 checks."], "b": ["Player 1 bets."],
             "pb": ["Player 1 checks.", "Player 2 bets."]}
    return " ".join(words[history])


OPPONENTS = ("nash", "random", "pool", "model", "endpoint", "self")
OUTSIDE = ("pool", "model", "endpoint")
"""Opponents that are an outside player handed over with ``set_opponent``."""
SEATS = ("first", "second")


class NashPlayer:
    """Plays the equilibrium strategy (``nash_strategy()``) in the policy's seat, reading its
    card and the betting from the env; a reference player (envs/reference.py)."""

    def __init__(self, env: KuhnPoker) -> None:
        self.env, self.strategy, self.rng = env, nash_strategy(), random.Random(0)

    def reset(self, first_observation: str) -> None:
        self.rng = random.Random(first_observation)

    def act(self, observation: str) -> str:
        env = self.env
        p_bet = self.strategy[(CARDS[env.cards[env.seat]], env.history)]
        pass_word, bet_word = ACTION_WORDS[env.history]
        return bet_word if self.rng.random() < p_bet else pass_word


@register_env("kuhn-poker")
class KuhnPoker:
    """Kuhn Poker (J < Q < K, ante 1, bet 1) against a built-in opponent.

    role: first, second, or both (by the seed's parity). opponent: nash (an equilibrium,
    first-player family ``alpha`` in [0, 1/3]), random, pool (frozen past policies, set by the
    trainer), model (another local model: env.opponent_model), endpoint (an OpenAI-compatible
    endpoint: env.opponent_endpoint) or self (self-play: the policy plays both seats, one episode per seat). Replies: check, bet, call or fold;
    an illegal one loses 2 chips. Reward: chips won / 2, in [-1, 1]; success: a won hand.
    Exploitability of a strategy: ``turnrl.envs.kuhn.exploitability``.
    """

    cooperative = True  # pure Python, never blocks
    zero_sum = True  # self-play: the seats' rewards sum to zero (checked by the turn loop)
    eval_opponents = ("random", "nash")  # what a self-play or pool run is evaluated against

    system_prompt = ("You are playing Kuhn Poker: three cards J < Q < K, one each, both ante 1 "
                     "chip. Player 1 checks or bets 1; facing a bet you call or fold; the higher "
                     "card wins at showdown. Reply with one word: check, bet, call or fold.")

    def __init__(self, role: str = "both", opponent: str = "nash", alpha: float = 1 / 6):
        if role not in ("first", "second", "both"):
            raise ValueError(f"kuhn-poker role must be first, second or both, got {role!r}")
        if opponent not in OPPONENTS:
            raise ValueError(f"kuhn-poker opponent must be nash or random (or pool, self), "
                             f"got {opponent!r}")
        self.role_option, self.opponent_option = role, opponent
        self.strategy = nash_strategy(alpha) if opponent == "nash" else dict(UNIFORM)
        self.cards, self.history, self.seat, self.rng = (0, 1), "", 0, random.Random(0)
        self.seats = SEATS if opponent == "self" else ()
        self.player, self.opponent_error, self.outcome_chips = None, "", None
        # an outside player may run a model on this env's thread: not cooperative then
        self.cooperative = opponent not in OUTSIDE

    @property
    def opponent(self) -> str:
        if self.opponent_option in OUTSIDE:
            return getattr(self.player, "name", self.opponent_option)
        return self.opponent_option

    def set_opponent(self, player) -> None:
        """Play ``player`` (``act(system_prompt, observation) -> str``, and a ``name``) in the
        other seat (``opponent: pool``)."""
        self.player = player

    def reference_player(self) -> NashPlayer:
        return NashPlayer(self)

    def _observation(self) -> str:
        return observation(self.seat, CARDS[self.cards[self.seat]], self.history)

    def policy_metrics(self, score) -> dict[str, float]:
        """The policy's exploitability, read from its log-probabilities (called at each
        evaluation, envs/contract.py): at each of the 12 information sets, the probability
        of the bet/call word among the two legal words, ``score`` giving each word's
        log-probability after the conversation the policy would have seen there."""
        strategy = {}
        for card, history in infosets(0) + infosets(1):
            messages = conversation(self.system_prompt, card, history)
            pass_word, bet_word = ACTION_WORDS[history]
            gap = score(messages, pass_word) - score(messages, bet_word)
            strategy[(card, history)] = 1 / (1 + math.exp(min(gap, 700.0)))
        br_first, br_second = best_response_values(strategy, strategy)
        return {"exploitability": (br_first + br_second) / 2,
                "best_response_first": br_first, "best_response_second": br_second}

    async def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        self.cards = tuple(self.rng.sample(range(3), 2))
        self.seat = {"first": 0, "second": 1}.get(self.role_option, seed % 2)
        self.history, self.opponent_error, self.outcome_chips = "", "", None
        if self.seats:
            return self.observe("first")
        if self.seat == 1:
            self._opponent_acts()
        return self._observation()

    def _opponent_acts(self) -> None:
        """The opponent's action; an outside player's illegal reply sets ``opponent_error``."""
        card = CARDS[self.cards[1 - self.seat]]
        if self.opponent_option in OUTSIDE:
            if self.player is None:
                raise RuntimeError(f"kuhn-poker opponent '{self.opponent_option}' has no player: the trainer hands "
                                   "one over (set_opponent); evaluate against nash or random")
            reply = self.player.act(self.system_prompt,
                                    observation(1 - self.seat, card, self.history))
            move = parse_action(reply, self.history)
            if move is None:
                self.opponent_error = f"expected {' or '.join(ACTION_WORDS[self.history])}"
                return
            self.history += move
            return
        p_bet = self.strategy[(card, self.history)]
        self.history += "b" if self.rng.random() < p_bet else "p"

    def _end(self, chips: int, outcome: str, **more) -> StepResult:
        info = {"role": ("first", "second")[self.seat], "opponent": self.opponent,
                "chips": chips, "outcome": outcome, "success": chips > 0,
                "cards": f"{CARDS[self.cards[0]]}{CARDS[self.cards[1]]}",
                "history": self.history, **more}
        return StepResult(f"Hand over: you {'win' if chips > 0 else 'lose'} {abs(chips)}.",
                          chips / 2, True, info)

    async def step(self, action: str) -> StepResult:
        if self.seats:
            return self._seat_step(action)
        if self.opponent_error:  # an outside player's illegal reply before the policy's
            return self._end(2, "win", reason=f"opponent's illegal action: {self.opponent_error}")
        move = parse_action(action, self.history)
        if move is None:
            words = " or ".join(ACTION_WORDS[self.history])
            return self._end(-2, "illegal", reason=f"illegal action: expected {words}")
        self.history += move
        if self.history not in TERMINAL:
            self._opponent_acts()
            if self.opponent_error:
                return self._end(2, "win",
                                 reason=f"opponent's illegal action: {self.opponent_error}")
        if self.history in TERMINAL:
            chips = payoff(self.cards, self.history) * (1 if self.seat == 0 else -1)
            return self._end(chips, "win" if chips > 0 else "loss")
        info = {"role": ("first", "second")[self.seat], "opponent": self.opponent}
        return StepResult(self._observation(), 0.0, False, info)

    # ---- self-play: both seats are the policy (``opponent: self``) ------------------------

    @property
    def seat_to_move(self) -> str:
        return SEATS[acting(self.history)]

    def observe(self, seat: str) -> str:
        """What ``seat`` reads: its card and the betting so far, or how the hand ended for it."""
        index = SEATS.index(seat)
        if self.outcome_chips is None:
            return observation(index, CARDS[self.cards[index]], self.history)
        chips = self.outcome_chips[seat]
        return (f"Hand over: you {'win' if chips > 0 else 'lose'} {abs(chips)} "
                f"(cards {CARDS[self.cards[0]]}{CARDS[self.cards[1]]}, betting {self.history}).")

    def _seat_step(self, action: str) -> StepResult:
        """The action of the seat to move; when it ends the hand, both seats' rewards."""
        mover = acting(self.history)
        move = parse_action(action, self.history)
        if move is None:
            why = f"expected {' or '.join(ACTION_WORDS[self.history])}"
            chips = -2 if mover == 0 else 2  # the first seat's chips
            return self._hand_over(chips, {SEATS[mover]: "illegal"},
                                   {SEATS[mover]: f"illegal action: {why}",
                                    SEATS[1 - mover]: f"opponent's illegal action: {why}"})
        self.history += move
        if self.history in TERMINAL:
            return self._hand_over(payoff(self.cards, self.history))
        return StepResult(self.observe(self.seat_to_move), 0.0, False, {})

    def _hand_over(self, first_chips: int, outcomes: dict[str, str] | None = None,
                   reasons: dict[str, str] | None = None) -> StepResult:
        self.outcome_chips = {"first": first_chips, "second": -first_chips}
        seats = {}
        for seat, chips in self.outcome_chips.items():
            outcome = (outcomes or {}).get(seat, "win" if chips > 0 else "loss")
            seats[seat] = {"reward": chips / 2, "role": seat, "opponent": "self", "chips": chips,
                           "outcome": outcome, "success": chips > 0,
                           "cards": f"{CARDS[self.cards[0]]}{CARDS[self.cards[1]]}",
                           "history": self.history,
                           **({"reason": reasons[seat]} if reasons else {})}
        return StepResult("Hand over.", 0.0, True, {"seats": seats})


@register_env("kuhn-poker-selfplay")
def kuhn_poker_selfplay(opponent: str = "self", alpha: float = 1 / 6) -> KuhnPoker:
    """Kuhn Poker self-play: the policy plays both seats, one episode per seat (zero-sum).

    Reward: chips won / 2. Evaluated against random and Nash opponents, per role, with the
    policy's exact exploitability. opponent: self, or any of ``kuhn-poker``'s (pool: frozen
    past policies). docs/selfplay.md."""
    return KuhnPoker(opponent=opponent, alpha=alpha)
