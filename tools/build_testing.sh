#!/usr/bin/env bash
# Builds _smddp_testing (the tests' probes into the engine; CMake option
# JAX_SMDDP_TESTING) against the jax of VENV and puts it on that environment's
# path as a top-level module. It is never part of the package or its wheel.
#   tools/build_testing.sh VENV_DIR
set -euo pipefail
venv=$1
[[ "$venv" = /* ]] || venv="$PWD/$venv"
root=$(cd "$(dirname "$0")/.." && pwd)
python="$venv/bin/python"
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
build="$root/build/testing-$tag"
"$venv/bin/cmake" -S "$root" -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" \
  -DPython_EXECUTABLE="$python" -DJAX_SMDDP_CUDA=OFF -DJAX_SMDDP_TESTING=ON >"$build.log" 2>&1 \
  || { cat "$build.log"; exit 1; }
"$venv/bin/cmake" --build "$build" --target _smddp_testing >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
cp "$build"/_smddp_testing*.so "$site/"
echo "_smddp_testing built into $site"
