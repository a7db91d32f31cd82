"""The tools' one byte-size parser and its formatters (jax_smddp/tools/sizes.py)."""

import argparse

import pytest

from jax_smddp.tools import sizes


@pytest.mark.parametrize("text,n", [("4096", 4096), ("4K", 4096), ("4k", 4096), ("16M", 16 << 20),
                                    ("1GiB", 1 << 30), ("64KB", 64 << 10), ("1.5M", 3 << 19)])
def test_parse(text, n):
  assert sizes.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "four", "-4K", "0"])
def test_parse_refuses_what_is_no_size(text):
  with pytest.raises(argparse.ArgumentTypeError):
    sizes.parse_size(text)


def test_formats_read_back():
  for n in (1, 1000, 4096, 3 << 19, 16 << 20, 3 << 30):
    assert sizes.parse_size(sizes.format_size(n)) == n  # exact: what it prints reads back
  assert sizes.format_size(1536) == "1536" and sizes.format_size(1536, exact=False) == "1.5K"
  assert sizes.format_bytes(3 << 19) == "1.50 MiB" and sizes.format_bytes(None) == "-"
  assert sizes.format_bytes(512) == "512 B"
