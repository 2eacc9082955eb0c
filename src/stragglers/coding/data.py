"""The n data parts of coded training: deterministic mini-batches per (part, step)."""

from __future__ import annotations

import numpy as np
import torch

from stragglers.errors import InputError


class PartitionedData:
    """A data set split into n equal parts; `batch(part, step)` is the same on every rank."""

    def __init__(self, X, y, n: int, batch_size: int | None = None, seed: int = 0):
        X = torch.as_tensor(X)
        y = torch.as_tensor(y)
        if len(X) != len(y):
            raise InputError("data", "y", f"expected {len(X)} labels, got {len(y)}")
        size = len(X) // n
        if size < 1:
            raise InputError("data", "n", f"{len(X)} samples cannot make {n} non-empty parts")
        if batch_size is not None and not 1 <= batch_size <= size:
            raise InputError("data", "batch_size", f"expected 1..{size} (the part size), "
                                                   f"got {batch_size}")
        # equal parts (the remainder is dropped) so the mean of part losses is the full-data mean
        order = torch.as_tensor(np.random.default_rng(seed).permutation(len(X))[: size * n])
        self.X = X[order].reshape(n, size, *X.shape[1:])
        self.y = y[order].reshape(n, size, *y.shape[1:])
        self.n = n
        self.part_size = size
        self.batch_size = batch_size

    def batch(self, part: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mini-batch `step` of part `part` (the whole part when batch_size is None)."""
        if self.batch_size is None:
            return self.X[part], self.y[part]
        per_epoch = self.part_size // self.batch_size
        start = (step % per_epoch) * self.batch_size
        return (self.X[part, start:start + self.batch_size],
                self.y[part, start:start + self.batch_size])

    def all(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample of every part (for evaluating the full training loss)."""
        return self.X.reshape(-1, *self.X.shape[2:]), self.y.reshape(-1, *self.y.shape[2:])


def load_digits_parts(n: int, batch_size: int | None = None, seed: int = 0) -> PartitionedData:
    """scikit-learn's bundled 8×8 digits (1797 images, no download), scaled to [0, 1], in n parts."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return PartitionedData(torch.tensor(X / 16.0, dtype=torch.float32),
                           torch.tensor(y, dtype=torch.long), n, batch_size, seed)
