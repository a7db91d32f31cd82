"""ppermute: rank i sends its value to rank j for each pair (i, j) of a permutation
(pipeline stages, ring attention, halo exchanges).

jax_smddp's engine has no collective-permute body yet: the call is jax.lax's
(XLA's collective-permute, on gloo across processes and NCCL on GPUs), logged
once as a fallback (an error under ``JAX_SMDDP_REQUIRE=no-fallback``). The
function is here so that a program written against jax_smddp's names runs
unchanged, with jax.lax's signature and answers.
"""

from __future__ import annotations

import jax

from jax_smddp import _collective as c
from jax_smddp import requirements


def ppermute(x, axis_name, perm):
  """Sends `x` from rank i to rank j for each (i, j) in `perm`, like
  :func:`jax.lax.ppermute` (ranks that receive nothing get zeros). Lowers
  through jax.lax: the engine has no collective-permute yet."""
  c.check_bound("ppermute", c.axes_tuple(axis_name))
  requirements.fallback("jax_smddp.ppermute lowers through jax.lax",
                        "jax_smddp's engine has no collective-permute body yet")
  return jax.lax.ppermute(x, axis_name, perm)
