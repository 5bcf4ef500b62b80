"""A character-level corpus that ships with Python: the source of ``argparse``.

Every rank reads the same file, so the vocabulary (the sorted set of its
characters) and the train/validation split are identical everywhere. Batches
are sampled from the train split by a generator seeded with ``(seed, step)``:
reproducible from ``--seed``, the same global batch whatever the PP x DP
layout, a different slice of it on each data-parallel replica, and the same
slice on the pipeline stages of one replica (the first stage needs the inputs,
the last the targets).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

import torch

TRAIN_FRACTION = 0.9


def default_corpus_path() -> Path:
    """The standard library's ``argparse.py`` (about 100 kB of Python source)."""
    return Path(argparse.__file__)


@dataclass(frozen=True)
class CharCorpus:
    """A text as token ids over its own character vocabulary, split train/validation."""

    vocab: str
    train: torch.Tensor
    validation: torch.Tensor

    @classmethod
    def from_text(cls, text: str) -> CharCorpus:
        """Tokenise ``text``: vocabulary = its sorted distinct characters."""
        if len(text) < 2:
            raise ValueError(f"text must hold at least 2 characters, got {len(text)}")
        vocab = "".join(sorted(set(text)))
        index = {ch: i for i, ch in enumerate(vocab)}
        ids = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        cut = int(len(ids) * TRAIN_FRACTION)
        return cls(vocab=vocab, train=ids[:cut], validation=ids[cut:])

    @classmethod
    def from_file(cls, path: Path | None = None) -> CharCorpus:
        """Read ``path`` (default: :func:`default_corpus_path`) as UTF-8."""
        return cls.from_text((path or default_corpus_path()).read_text(encoding="utf-8"))

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.vocab)

    def decode(self, ids: torch.Tensor) -> str:
        """Token ids back to text."""
        return "".join(self.vocab[i] for i in ids.tolist())

    def sample_microbatches(
        self,
        *,
        seed: int,
        step: int,
        dp_rank: int,
        dp_size: int,
        num_microbatches: int,
        micro_batch_size: int,
        seq_length: int,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Replica ``dp_rank``'s ``num_microbatches`` (inputs, targets) pairs for ``step``.

        Each has shape (micro_batch_size, seq_length); targets are the inputs
        shifted by one character. The global batch (``dp_size x
        num_microbatches x micro_batch_size`` windows at uniformly drawn
        offsets of the train split) depends only on ``(seed, step)``; replica
        ``d`` takes the ``d``-th contiguous slice of it. So the data of a step
        is the same whatever the split into replicas and microbatches.
        """
        if seq_length + 1 > len(self.train):
            raise ValueError(
                f"seq_length={seq_length} must be < the train split's {len(self.train)} characters"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        # A string seed is hashed with SHA-512 by random.Random: stable across
        # runs and processes (unlike hash()).
        rng = random.Random(f"{seed}/{step}")
        high = len(self.train) - seq_length - 1
        per_replica = num_microbatches * micro_batch_size
        starts = [rng.randint(0, high) for _ in range(dp_size * per_replica)]
        mine = starts[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        inputs, targets = [], []
        for first in range(0, per_replica, micro_batch_size):
            windows = torch.stack(
                [self.train[s : s + seq_length + 1] for s in mine[first : first + micro_batch_size]]
            )
            inputs.append(windows[:, :-1].contiguous())
            targets.append(windows[:, 1:].contiguous())
        return inputs, targets
