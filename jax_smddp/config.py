"""Settings of jax_smddp, read from the environment at import.

JAX_SMDDP_TIMEOUT_S   deadline, in seconds, for every wait inside a collective
                      (a peer that never arrives); default 300.
"""

from __future__ import annotations

import os

from jax_smddp import _native

DEFAULT_TIMEOUT_S = 300.0


def set_timeout(seconds: float) -> None:
  """Sets the deadline for every wait inside a collective, in seconds.

  When a peer does not reach a collective in time, every waiting rank fails
  with an error naming the collective, the communicator and the missing ranks.
  """
  seconds = float(seconds)
  if not seconds > 0:
    raise ValueError(f"jax_smddp.set_timeout: the timeout must be positive, got {seconds}")
  _native.engine().set_timeout(seconds)
  cuda = _native.cuda_engine()
  if cuda is not None:  # its own engine copy (the GPU network proxy's deadline)
    cuda.set_timeout(seconds)


def timeout() -> float:
  """The current deadline for waits inside a collective, in seconds."""
  return _native.engine().timeout()


def _timeout_from_env() -> float:
  raw = os.environ.get("JAX_SMDDP_TIMEOUT_S")
  if raw is None:
    return DEFAULT_TIMEOUT_S
  try:
    return float(raw)
  except ValueError:
    raise ValueError(f"JAX_SMDDP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None


set_timeout(_timeout_from_env())
