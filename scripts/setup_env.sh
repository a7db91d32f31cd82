#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with jax and builds jax_smddp into it.
#   scripts/setup_env.sh PYTHON VENV_DIR JAX_SPEC [EXTRA_PIP_PACKAGES...]
# The plugin is compiled against the FFI headers of the jaxlib installed in
# that environment, so each jax version gets its own environment and build.
set -euo pipefail
python=$1 venv=$2 jax_spec=$3
[[ "$venv" = /* ]] || venv="$PWD/$venv"
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -x "$venv/bin/python" ]; then
  $python -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip "$@"; }
pip install -q --disable-pip-version-check --upgrade pip >/dev/null
# The example's packages on the same line as jax, so they resolve against it
# (newer flax releases need a newer jax).
pip install -q --disable-pip-version-check "$jax_spec" numpy nanobind "scikit-build-core>=0.10" \
  cmake ninja pytest pytest-timeout flax optax orbax-checkpoint tqdm "$@"
# --no-build-isolation: build against the jax installed above, not a newer one.
# -e (editable): Python reads the package's .py files from the checkout and its
# native modules from this environment's site-packages (pyproject.toml), so
# `python -m jax_smddp...` works from the checkout's root too, and each
# environment keeps its own build (build/<wheel tag>) against its own jaxlib.
pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e "$root"
(cd "$root" && "$venv/bin/python" -c "
import jax, jax_smddp
from jax_smddp import capabilities
parts = ['CUDA backend built' if capabilities.cuda()['built'] else 'CPU only: no nvcc',
         'libfabric built' if capabilities.fabric()['built'] else 'NO libfabric: one host only']
print('jax', jax.__version__, '+ jax_smddp', jax_smddp.__version__, '(' + '; '.join(parts) + ') in $venv;',
      'python -m jax_smddp.doctor says what it can do here')")
