"""One game as it was played, for report.html: every seat's moves in play order.

A self-play game is one episode per seat (docs/selfplay.md). Each seat's transcript
(``evaluation.episode_transcript``) holds that seat's moves (what it played, what it saw
next) and ``game``: its ``role``, ``opponent``, ``game_id`` and ``play_order`` (the seat of
each move, in order; the k-th entry naming seat S is S's k-th turn). The game view walks
``play_order`` and takes each seat's next move, so the two conversations become one game:
move number, seat, who played it (the policy, or the opponent's name), what it played and
what that seat saw before it; then each seat's reward and outcome. A game against an
opponent (a pool version, another model, a scripted player) is one episode: its moves are the
policy's, the opponent's replies reach it inside the environment's text, shown under the
opponent's name.
"""

from __future__ import annotations

from html import escape
from typing import Any

from turnrl.report.data import finite

MAX_GAMES = 4
"""Games shown per sample file (a step's, the held-out evaluation's, ``turnrl eval``'s)."""


def _game(transcript: Any) -> dict | None:
    game = transcript.get("game") if isinstance(transcript, dict) else None
    return game if isinstance(game, dict) and "role" in game else None


def game_groups(samples: list[tuple[str, list]]) -> list[tuple[str, list[dict]]]:
    """(where from, the seats' transcripts) of each game among the samples, in the order
    they first appear: the seats of a self-play game together (same env, seed, group and
    ``game_id``), a game against an opponent alone."""
    games: dict[tuple, tuple[str, list[dict]]] = {}
    for origin, transcripts in samples:
        for i, t in enumerate(transcripts):
            game = _game(t)
            if game is None:
                continue
            game_id = game.get("game_id")
            key = ((origin, t.get("env"), t.get("seed"), t.get("group"), str(game_id))
                   if game_id is not None else (origin, i))
            games.setdefault(key, (origin, []))[1].append(t)
    return list(games.values())


def interleaved_moves(seats: list[dict]) -> list[dict]:
    """The moves of one game in play order: ``{"number", "seat", "player", "action", "saw",
    "reply"}`` each. ``saw`` is what the seat saw before the move (its first prompt, or what
    came after its previous move); ``reply`` is the environment's answer, shown only for a
    game against an opponent (it holds the opponent's move). The moves of a seat whose
    transcript is missing are left out (their numbers too); ``ValueError`` when
    ``play_order`` names more turns of a seat than its transcript holds."""
    by_seat = {str(_game(t)["role"]): t for t in seats}
    order = _game(seats[0]).get("play_order")
    one_seat = not isinstance(order, list)
    if one_seat:  # a game against an opponent: the policy's moves, one seat
        order = [str(_game(seats[0])["role"])] * len(_moves(seats[0]))
    taken = dict.fromkeys(by_seat, 0)
    moves = []
    for number, seat in enumerate(order, 1):
        seat = str(seat)
        if seat not in by_seat:  # that seat's episode is not among the samples
            continue
        transcript, k = by_seat[seat], taken[seat]
        own = _moves(transcript)
        if k >= len(own):
            raise ValueError(f"play_order gives seat {seat} more moves than its "
                             f"{len(own)} turns")
        saw = _first_prompt(transcript) if k == 0 else str(own[k - 1].get("observation", ""))
        moves.append({"number": number, "seat": seat, "player": "policy",
                      "action": str(own[k].get("action", "")), "saw": saw,
                      "reply": str(own[k].get("observation", "")) if one_seat else ""})
        taken[seat] = k + 1
    return moves


def _moves(transcript: dict) -> list[dict]:
    moves = transcript.get("moves")
    return [m for m in moves if isinstance(m, dict)] if isinstance(moves, list) else []


def _first_prompt(transcript: dict) -> str:
    """The seat's first view: the environment's part before its first reply."""
    segments = transcript.get("segments")
    first = segments[0] if isinstance(segments, list) and segments else None
    return str(first.get("text", "")) if isinstance(first, dict) and \
        first.get("role") != "policy" else ""


def _number(value: Any) -> str:
    number = finite(value)
    return "?" if number is None else f"{number:g}"


def _seat_rows(seats: list[dict]) -> str:
    """A row per seat: who played it, its reward, outcome and how its episode ended."""
    rows = []
    for t in seats:
        game = _game(t)
        opponent = str(game.get("opponent", "?"))
        against = "" if opponent == "self" else f" (against {opponent})"
        cells = [str(game["role"]), f"policy{against}", _number(t.get("reward")),
                 str(game.get("outcome", "-")), f"{t.get('status', '?')}"
                 f"{', ' + str(t['reason']) if t.get('reason') else ''}"]
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("seat", "played by", "reward", "outcome",
                                              "ended"))
    return f'<table class="eval seats"><thead><tr>{head}</tr></thead>' \
        f'<tbody>{"".join(rows)}</tbody></table>'


def _move_html(move: dict, seat_index: int, opponent: str) -> str:
    saw = (f'<details class="saw"><summary>what {escape(move["seat"])} saw</summary>'
           f'<pre>{escape(move["saw"])}</pre></details>') if move["saw"] else ""
    reply = (f'<div class="msg env"><span class="who">environment, with opponent '
             f'{escape(opponent)}\'s move</span><pre>{escape(move["reply"])}</pre></div>'
             ) if move["reply"] else ""
    return (f'<div class="move seat{seat_index % 2}" data-seat="{escape(move["seat"])}" '
            f'data-move="{move["number"]}"><span class="who">move {move["number"]} · seat '
            f'{escape(move["seat"])} · {escape(move["player"])}</span>{saw}'
            f'<pre>{escape(move["action"])}</pre></div>{reply}')


def render_game(origin: str, seats: list[dict], open_: bool = False) -> str:
    """One game, its seats' moves interleaved in play order (see the module docstring); a
    game whose files do not fit together says so in its place."""
    first = _game(seats[0])
    opponent = str(first.get("opponent", "?"))
    roles = [str(_game(t)["role"]) for t in seats]
    rewards = ", ".join(f"{r} {_number(t.get('reward'))}" for r, t in zip(roles, seats,
                                                                          strict=True))
    who = " vs ".join(roles) + (" (self-play)" if opponent == "self" else f" vs {opponent}")
    game_id = first.get("game_id")
    which = "" if game_id is None else f", game {game_id}"
    head = f"{origin}, seed {seats[0].get('seed')}{which}: {who}; rewards {rewards}"
    try:
        moves = interleaved_moves(seats)
    except (ValueError, KeyError, TypeError) as err:
        body = f'<p class="note">the seats\' files do not fit together: {escape(str(err))}</p>'
    else:
        index = {role: i for i, role in enumerate(roles)}
        body = "".join(_move_html(m, index[m["seat"]], opponent) for m in moves)
        if opponent == "self" and len(seats) < 2:
            body += '<p class="note">the other seat\'s episode is not in the samples</p>'
    return (f'<details class="game"{" open" if open_ else ""} data-opponent="{escape(opponent)}">'
            f"<summary>{escape(head)}</summary>{_seat_rows(seats)}{body}</details>")


def games_section(samples: list[tuple[str, list]]) -> str:
    """The run's "Games" part: up to ``MAX_GAMES`` games of each sample file; '' when no
    sample is a game."""
    games, per_origin = [], {}
    for origin, seats in game_groups(samples):
        per_origin[origin] = per_origin.get(origin, 0) + 1
        if per_origin[origin] <= MAX_GAMES:
            games.append((origin, seats))
    if not games:
        return ""
    shown = "".join(render_game(origin, seats, i == 0) for i, (origin, seats)
                    in enumerate(games))
    return ("<h3>Games</h3><p>Each game move by move, in the order it was played: the seat "
            "and who played it, what that seat saw before it; each seat's reward.</p>"
            + shown)


GAME_STYLE = """
details.game{border:1px solid #ddd;margin:6px 0;padding:4px 8px}
.move{margin:4px 0;padding:4px 8px;border-radius:6px;max-width:80%}
.move.seat0{background:#e6f0fb;border-left:4px solid #1f77b4}
.move.seat1{background:#fdf0e2;border-left:4px solid #ff7f0e;margin-left:18%}
.move .who{font-size:11px;text-transform:uppercase;color:#555}
.move pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;font:13px/1.35 monospace}
details.saw summary{font-size:11px;color:#777}p.note{color:#8a5a00}
"""
