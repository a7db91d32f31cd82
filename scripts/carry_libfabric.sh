#!/usr/bin/env bash
# Copies this machine's libfabric (libfabric.so.1, the libraries it loads, and
# its headers) into .fab/ at the repository root, ignored by git, for a GPU
# machine whose image has no libfabric, laid out as a libfabric prefix
# (include/rdma, lib/): scripts/gpu_check.sh builds with it through
# JAX_SMDDP_LIBFABRIC_ROOT and runs with lib/ on the loader path when it is
# there (carry .fab/ to the GPU machine with the checkout).
#   bash scripts/carry_libfabric.sh      # needs libfabric-dev here (apt-get install libfabric-dev)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# awk reads to the end: leaving early would kill ldconfig with SIGPIPE, which
# pipefail turns into this script's failure (exit 141) when the cache is long.
lib=$(ldconfig -p | awk '/libfabric\.so\.1 / && !f {f = $NF} END {print f}')
[ -n "$lib" ] || { echo "libfabric.so.1 not found: apt-get install libfabric-dev" >&2; exit 1; }
[ -f /usr/include/rdma/fabric.h ] || { echo "libfabric headers not found: apt-get install libfabric-dev" >&2; exit 1; }
rm -rf "$root/.fab"
mkdir -p "$root/.fab/include" "$root/.fab/lib"
cp -L "$lib" "$root/.fab/lib/"
# Every library it loads except the C library, which the GPU machine has.
ldd "$lib" | awk '/=> \//{print $3}' | grep -v -E '/libc\.so|/ld-linux' | while read -r dep; do
  cp -L "$dep" "$root/.fab/lib/"
done
cp -r /usr/include/rdma "$root/.fab/include/"
exclude=$(git -C "$root" rev-parse --path-format=absolute --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.fab/' "$exclude" 2>/dev/null || echo '/.fab/' >> "$exclude"
du -sh "$root/.fab"
