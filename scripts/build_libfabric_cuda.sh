#!/usr/bin/env bash
# Builds libfabric with CUDA support (FI_HMEM_CUDA, CUDA loaded at run time)
# into .fab/ at the repository root, ignored by git, in the layout
# scripts/carry_libfabric.sh makes: for a GPU machine, where device memory
# registered with a rail (JAX_SMDDP_FABRIC_HMEM=auto) needs a libfabric built
# with CUDA. Debian's is not, and the GPU image has none; the EFA installer's
# is. No GPU is needed to build: the CUDA headers come with nvcc, NVML's
# header from PyPI (nvidia-nvml-dev-cu12).
#   LIBFABRIC_SRC=/path/to/libfabric bash scripts/build_libfabric_cuda.sh
# LIBFABRIC_SRC: a libfabric source tree (a release tarball's, or a checkout:
# then autogen.sh runs; needs autoconf, automake, libtool). Built here with
# v1.22.0. Providers: shm, tcp, rxm (what the tests use).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src=${LIBFABRIC_SRC:?set LIBFABRIC_SRC to a libfabric source tree}
# The CUDA toolkit (its headers): CUDA_HOME, else /usr/local/cuda, else where nvcc is.
cuda=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda/include/cuda_runtime.h" ] && command -v nvcc >/dev/null; then
  cuda=$(cd "$(dirname "$(readlink -f "$(command -v nvcc)")")/.." && pwd)
fi
[ -f "$cuda/include/cuda_runtime.h" ] || { echo "no CUDA headers found: set CUDA_HOME" >&2; exit 1; }
work=$(mktemp -d /tmp/jax_smddp_libfabric.XXXXXX)
trap 'rm -rf "$work"' EXIT
# NVML's header (libfabric's CUDA support includes it; the library is loaded
# at run time, if present).
python3 -m pip download --no-deps -q nvidia-nvml-dev-cu12 -d "$work/nvml" >/dev/null
python3 -m zipfile -e "$work"/nvml/*.whl "$work/nvml/x"
mkdir -p "$work/include"
cp "$(find "$work/nvml/x" -name nvml.h -print -quit)" "$work/include/"
cp -r "$src" "$work/src"
cd "$work/src"
[ -x configure ] || ./autogen.sh >"$work/autogen.log" 2>&1
./configure --prefix="$work/install" --with-cuda="$cuda" --enable-cuda-dlopen \
  CPPFLAGS="-I$cuda/include -I$work/include" --disable-static \
  --enable-shm --enable-tcp --enable-rxm --enable-sockets=no --enable-verbs=no --enable-efa=no \
  --enable-psm2=no --enable-psm3=no --enable-usnic=no --enable-opx=no --enable-udp=no \
  >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log"; exit 1; }
grep -q '^#define HAVE_CUDA 1' config.h || { echo "configure found no CUDA" >&2; exit 1; }
make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -30 "$work/make.log"; exit 1; }
make install >"$work/install.log" 2>&1
rm -rf "$root/.fab"
mkdir -p "$root/.fab/include" "$root/.fab/lib" "$root/.fab/bin"
cp -L "$work/install/lib/libfabric.so.1" "$root/.fab/lib/"
cp "$work/install/bin/fi_info" "$root/.fab/bin/"
cp -r "$work/install/include/rdma" "$root/.fab/include/"
# scripts/gpu_check.sh reads this: libfabric opens "libcudart.so" and
# "libcuda.so" by those names, which a GPU image may only have versioned.
echo "libfabric $("$work/install/bin/fi_info" --version | awk '/^libfabric:/{print $2}') with CUDA (dlopen)" \
  >"$root/.fab/CUDA_BUILD"
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.fab/' "$exclude" 2>/dev/null || echo '/.fab/' >> "$exclude"
cat "$root/.fab/CUDA_BUILD"
du -sh "$root/.fab"
