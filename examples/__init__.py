"""Runnable examples: a small GPT trained with fastgrad (``examples/train_gpt.py``)."""
