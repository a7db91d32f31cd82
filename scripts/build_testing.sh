#!/usr/bin/env bash
# Builds what the tests need beside the package (CMake option
# JAX_SMDDP_TESTING, target smddp_tests) against the jax of VENV: the
# _smddp_testing module of probes into the engine, put on that environment's
# path as a top-level module (never part of the package or its wheel), and
# the native test programs, left in build/testing-<python tag>/ where the
# tests find them (tests/helpers.py: native_program).
#   scripts/build_testing.sh VENV_DIR
set -euo pipefail
venv=$1
[[ "$venv" = /* ]] || venv="$PWD/$venv"
root=$(cd "$(dirname "$0")/.." && pwd)
python="$venv/bin/python"
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
build="$root/build/testing-$tag"
"$venv/bin/cmake" -S "$root" -B "$build" -G Ninja -DCMAKE_MAKE_PROGRAM="$venv/bin/ninja" \
  -DPython_EXECUTABLE="$python" -DJAX_SMDDP_TESTING=ON -DJAX_SMDDP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=80 >"$build.log" 2>&1 \
  || { cat "$build.log"; exit 1; }
# scripts/test.sh's second suite runs none of the native programs (tests/helpers.py:
# ran_in_first_suite): it builds the module alone, 40 s less.
target=smddp_tests
[ "${SMDDP_FIRST_SUITE_RAN:-}" = 1 ] && target=_smddp_testing
"$venv/bin/cmake" --build "$build" --target "$target" >>"$build.log" 2>&1 || { cat "$build.log"; exit 1; }
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
for so in "$build"/_smddp_testing*.so; do  # replaced, not overwritten: a running test keeps its copy
  cp "$so" "$site/.$(basename "$so").new" && mv -f "$site/.$(basename "$so").new" "$site/$(basename "$so")"
done
if [ "$target" = smddp_tests ]; then
  echo "_smddp_testing built into $site; native test programs in $build"
else
  echo "_smddp_testing built into $site (SMDDP_FIRST_SUITE_RAN=1: no native test programs)"
fi
