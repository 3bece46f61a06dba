"""Supervised fine-tuning on demonstrations (``turnrl sft``; docs/sft.md).

``train``: the SFT loop over the run machinery RL uses (run dir, checkpoints, resume);
``warmup``: the warm-up stage of ``turnrl train``. The demonstrations themselves (reading,
tokenising as the turn loop would, scripted players) are in ``turnrl.demos``.
"""
