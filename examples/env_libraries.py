"""Train on environments from other libraries, or wrap a single-turn task in "try again".

    pip install 'turnrl[envs]'
    python examples/env_libraries.py                                  # FrozenLake, tiny model
    python examples/env_libraries.py --env.name try-again --env.options.inner arithmetic

Each adapter is an ordinary registered environment, so any ``turnrl train`` flag works.
"""

import sys

from turnrl.cli import main

if __name__ == "__main__":
    defaults = ["--env.name", "gymnasium", "--env.options.game", "FrozenLake-v1",
                "--model.name", "tiny", "--run.steps", "2", "--eval.episodes", "4",
                "--run.out_dir", "runs/env_libraries"]
    sys.exit(main(["train", *defaults, *sys.argv[1:]]))  # later flags win
