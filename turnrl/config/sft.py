"""The ``sft`` config section: supervised fine-tuning on demonstrations (docs/sft.md).

``turnrl sft --sft.data FILE.jsonl`` trains ``run.steps`` optimisation steps with the
``optim`` section's AdamW; run directory, checkpoints and ``--resume`` are the RL run's.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnrl.config.types import Section


@dataclass(frozen=True)
class SftConfig(Section):
    steps: int = 0
    """turnrl train: a warm-up of this many SFT steps before RL (its run in RUN_DIR/sft; RL
    starts from its last checkpoint); turnrl sft itself takes run.steps"""
    lr: float = 0.0
    """the warm-up's AdamW learning rate (0 = optim.lr)"""
    data: str = ""
    """JSONL file of demonstrations, a conversation a line in the OpenAI chat format:
    {"messages": [...], "tools": [...]}; or turnrl serve's recorded episodes.jsonl, a run's
    episodes/*.jsonl, or a local Hugging Face dataset (.parquet, .arrow, a save_to_disk
    directory); turnrl sft needs it, sft.env_demos or sft.self_rounds (docs/sft.md)"""
    env_demos: int = 0
    """scripted demonstrations: play seeds 0..N-1 of env.name with its reference player
    (envs/reference.py) and train on the successful episodes too (or alone, without data)"""
    batch_size: int = 8
    """conversations per optimisation step (split into optim.micro_batch_size rows)"""
    eval_fraction: float = 0.1
    """share of the conversations held out (seeded by run.seed) for the held-out loss; at
    least one when above 0 and there are two or more"""
    eval_every: int = 0
    """held-out loss every N steps (0 = at each checkpoint and the last step)"""
    skip_unfit: bool = True
    """skip, with a line on stderr naming its file and line, a conversation the chat template
    cannot render as the turn loop would (false = stop at the first)"""
    min_reward: float = 0.0
    """rows that carry a reward (turnrl serve recordings, a run's episodes) are left out below
    it, e.g. 1 keeps only successes; chat-format conversations carry none"""
    eval_env: bool = False
    """also play eval.episodes held-out episodes of env.name before and after (and every
    eval.every steps): for demonstrations of that env's task"""

    self_rounds: int = 0
    """filtered self-imitation (rejection-sampling fine-tuning): rounds of play -> keep the
    successes -> fine-tune on them, the steps (run.steps; sft.steps for the warm-up) divided
    evenly over the rounds; 0 = off (docs/sft.md)"""
    self_samples: int = 8
    """attempts the current model plays at each task of a round (at rollout.temperature)"""
    self_tasks: int = 8
    """training seeds a round plays: round k (from 0) plays seeds k*N ... (k+1)*N-1, below
    eval.seed_offset"""

    def _check(self) -> None:
        self._require("eval_fraction", 0 <= self.eval_fraction < 1, "in [0, 1)")
        self._at_least(1, "batch_size")
        self._at_least(0, "eval_every", "env_demos", "steps", "lr", "self_rounds")
        self._at_least(1, "self_samples", "self_tasks")
