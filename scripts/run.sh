#!/usr/bin/env bash
# Sets up jax_smddp (Python 3.11, jax 0.10.2) and runs the main job: FSDP
# training of a small transformer on 8 CPU devices, every collective on
# jax_smddp (examples/README.md). Arguments go to the example, e.g.
# `--collectives xla` for the same run on jax.lax, `--mesh 2x4` for hybrid.
# The collectives benchmark: .venv/py311/bin/python -m jax_smddp.tools.bench
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/system_packages.sh
bash scripts/setup_env.sh python3.11 .venv/py311 "jax==0.10.2" matplotlib
exec .venv/py311/bin/python examples/fsdp_train.py "$@"
