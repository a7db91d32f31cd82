"""Byte sizes as the tools read and print them: the one parser and its formatters."""

from __future__ import annotations

import argparse

SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # binary, as nccl-tests' -b/-e


def parse_size(text: str) -> int:
  """Parses ``"4K"``, ``"16M"``, ``"1GiB"``, ``"4096"`` (binary suffixes) into bytes;
  raises argparse.ArgumentTypeError (a command-line error) for anything else."""
  t = text.strip().upper()
  for unit in ("IB", "B"):
    if t.endswith(unit) and len(t) > len(unit):
      t = t[:-len(unit)]
      break
  num, scale = (t[:-1], SUFFIXES[t[-1]]) if t and t[-1] in SUFFIXES else (t, 1)
  try:
    value = int(float(num) * scale)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 4K, 16M, 1G)") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
  return value


def format_size(nbytes: float, exact: bool = True) -> str:
  """As parse_size reads it: 4096 -> '4K', 16777216 -> '16M'; a size that is no whole
  multiple of a suffix prints in bytes (exact) or to one decimal ('1.5M', not exact)."""
  for suffix in ("G", "M", "K"):
    scale = SUFFIXES[suffix]
    if nbytes >= scale and (not exact or nbytes % scale == 0):
      v = nbytes / scale
      return f"{v:.0f}{suffix}" if v == int(v) else f"{v:.1f}{suffix}"
  return f"{nbytes:.0f}"


def format_bytes(n: float | None) -> str:
  """For tables of amounts: '2.01 MiB', '512 B', '-' for None."""
  if n is None:
    return "-"
  for suffix in ("G", "M", "K"):
    if n >= SUFFIXES[suffix]:
      return f"{n / SUFFIXES[suffix]:.2f} {suffix}iB"
  return f"{n:.0f} B"
