"""Supervised fine-tuning on demonstrations (``turnrl sft``; docs/sft.md).

``conversation``: one OpenAI-format conversation -> an ``Episode`` tokenised exactly as the
turn loop tokenises a played one; ``data``: the JSONL reader with one-line errors;
``train``: the SFT loop over the run machinery RL uses (run dir, checkpoints, resume).
"""
