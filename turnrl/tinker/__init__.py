"""A Tinker-compatible training service: the real ``tinker`` client drives TurnRL's LoRA
learner and sampler over HTTP (``turnrl tinker``; docs/tinker.md).

``losses`` holds Tinker's built-in losses as pure functions, ``wire`` the protobuf codec of
the two binary payloads (forward_backward in, its output and sample results out), ``models``
one client's adapter with its optimiser and the sampler, ``service`` sessions, futures and
paths, ``app`` the FastAPI routes.
"""
