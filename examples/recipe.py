"""The RL loop written out: the first page to read (what `turnrl train` runs in sync mode).

    python examples/recipe.py --model.name tiny --run.steps 3

start_run -> collect -> rl_step -> publish -> end_step, with a held-out evaluation before
and after. `turnrl.trainer.learn(cfg, source)` is this loop for every source (Ray workers,
a served agent, demonstrations); these are the library's own pieces, so the recipe trains
the same weights as `turnrl train` (tests/test_examples.py checks it bit for bit).
"""

import sys

from turnrl.config import load_config
from turnrl.trainer.bookkeeping import end_step, finish_run, step_logging
from turnrl.trainer.evaluation import evaluate_env
from turnrl.trainer.local import LocalSource
from turnrl.trainer.rl_step import StageTimer, rl_step
from turnrl.trainer.run import start_run


def recipe(cfg):
    run = start_run(cfg, resume=False)          # run dir, seeds, policy + sampler, learner
    source = LocalSource()                       # lock-step: the learner's own sampler plays
    source.open(run)
    model = run.learner.model
    source.publish(run.start_step, model)        # the sampler samples these weights
    before = evaluate_env(run, "before")         # held-out seeds, never trained on
    with step_logging(run, cfg.env.name) as (logger, progress):
        for step in range(run.start_step, cfg.run.steps):
            timer = StageTimer()                 # each stage timed: metrics time/*_s
            with timer("collect"):
                episodes = source.collect(step)  # groups of episodes, every token's facts
            # advantages (algo.advantage) -> policy update (algo.loss) -> metrics
            summary, metrics = rl_step(run.learner, episodes, timer)
            with timer("publish"):
                source.publish(step + 1, model)  # tokens from now on: the new weights
            metrics.update(source.step_metrics(step, episodes, metrics))
            # metrics.jsonl, sample episodes, the progress bar, an atomic checkpoint
            end_step(run, step, episodes, summary, metrics, timer, logger, progress,
                     checkpoint_extra=source.state_dict())
    after = evaluate_env(run, "after")
    result = finish_run(run, before, after, source.held_out(cfg))  # the before/after table
    source.close()
    return result


if __name__ == "__main__":
    recipe(load_config(None, sys.argv[1:]))
