#!/usr/bin/env bash
# Sets up jax_smddp (Python 3.11, jax 0.10.2) and runs the main job: the
# collectives benchmark, jax_smddp beside jax.lax, on 8 CPU devices.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash tools/setup_env.sh python3.11 .venv/py311 "jax==0.10.2" matplotlib
exec .venv/py311/bin/python -m jax_smddp.bench --devices 8 "$@"
