"""``turnrl serve``: the policy behind an OpenAI-compatible endpoint, recording episodes.

docs/serving.md describes the endpoint, the recording (episode ids, merging, segments,
rewards) and ``train_agent``.
"""

from turnrl.serve.record import (
    Call,
    RecordedEpisode,
    Recorder,
    Segment,
    extended_segment,
    merge_call,
    prompt_ids,
    training_episodes,
)
from turnrl.serve.server import Server, load_server

__all__ = ["Call", "RecordedEpisode", "Recorder", "Segment", "Server", "extended_segment",
           "load_server", "merge_call", "prompt_ids", "training_episodes"]
