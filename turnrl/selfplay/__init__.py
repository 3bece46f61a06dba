"""Self-play's own pieces: who plays a two-seat game's other seat, and what games say.

Opponents a game can be set to (``--env.options.opponent``, docs/selfplay.md): ``self`` (the
policy in every seat: one episode per seat, played by the turn loop's seat collaborator,
rollout/seats.py), ``pool`` (a frozen past policy from an ``OpponentPool``), ``model`` (another
local model, ``ModelOpponent``), ``endpoint`` (an agent behind an OpenAI-compatible endpoint,
``EndpointOpponent``: recorded as ``endpoint:<model>``), the game's scripted player
(TicTacToe's minimax, Kuhn Poker's Nash strategy) and ``random``. Each episode records its
``role`` and ``opponent`` in ``info``; a pool opponent is named ``pool-v<version>``, the
training step its weights are from.

Modules: ``opponents`` (``FrozenPolicy``, the pool's and a local model's players, and
``attach_player``, which hands a player to each new env), ``pool`` (``OpponentPool``: its
rule, its draws, its checkpoints), ``endpoint`` (``EndpointOpponent``), ``batched_calls``
(the moves games ask of one frozen model at once, generated in one batch), ``outcomes``
(per-role win/draw/loss rates and a step's game metrics) and ``evaluation`` (what a
self-play run is evaluated against). The games themselves are envs (envs/tictactoe.py,
envs/kuhn.py; the seat protocol in envs/contract.py); an async run's pool in checkpoints is
distributed/pool_state.py; the report's game view is report/games.py.
"""
