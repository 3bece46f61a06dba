"""Demonstrations as episodes: reading them (data.py), tokenising a conversation exactly as the
turn loop would have (conversation.py), and an env's scripted player writing them
(scripted.py). Used by supervised fine-tuning (``turnrl.sft``) and by guidance in RL
(``turnrl.trainer.guidance``)."""
