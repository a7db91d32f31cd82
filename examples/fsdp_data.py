"""Training data for the FSDP example: bytes of Python's own standard library.

Real text that every machine has offline and that is the same on every run: the
`.py` files next to `os.py`, sorted by name, concatenated (first `max_bytes`), read
as byte-level tokens (vocabulary 256). The last `eval_fraction` of the bytes is held
out for evaluation.

Training batches are drawn at random positions, but the generator is seeded by
(seed, step), so the batch of step s is the same whatever happened before it: a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np

VOCAB = 256


def stdlib_bytes(max_bytes: int) -> bytes:
  """The first `max_bytes` of the sorted stdlib `.py` files, one newline between files."""
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  chunks, total = [], 0
  for path in files:
    with open(path, "rb") as f:
      data = f.read() + b"\n"
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return b"".join(chunks)[:max_bytes]


@dataclasses.dataclass(frozen=True)
class ByteDataset:
  train: np.ndarray      # uint8 tokens
  eval: np.ndarray       # uint8 tokens, held out (the end of the text)
  seq_len: int

  @classmethod
  def from_stdlib(cls, seq_len: int, max_bytes: int = 2 << 20,
                  eval_fraction: float = 0.05) -> "ByteDataset":
    tokens = np.frombuffer(stdlib_bytes(max_bytes), dtype=np.uint8)
    split = int(len(tokens) * (1.0 - eval_fraction))
    if split < seq_len + 1 or len(tokens) - split < seq_len + 1:
      raise ValueError(f"{len(tokens)} bytes of text are too few for seq_len={seq_len}")
    return cls(train=tokens[:split], eval=tokens[split:], seq_len=seq_len)

  def train_batch(self, step: int, batch: int, seed: int = 0) -> np.ndarray:
    """`batch` windows of seq_len + 1 tokens (inputs and next-token targets), int32."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(self.train) - self.seq_len - 1, size=batch)
    return self._windows(self.train, starts)

  def eval_batches(self, batch: int, num_batches: int) -> list[np.ndarray]:
    """Evenly spaced windows over the held-out text, the same on every call."""
    n = batch * num_batches
    starts = np.linspace(0, len(self.eval) - self.seq_len - 1, n).astype(np.int64)
    return [self._windows(self.eval, starts[i * batch:(i + 1) * batch])
            for i in range(num_batches)]

  def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
    return tokens[idx].astype(np.int32)
