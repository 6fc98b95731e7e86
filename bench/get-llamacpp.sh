#!/usr/bin/env bash
# bench/get-llamacpp.sh BUILD: builds llama.cpp's llama-bench (and llama-completion and
# llama-perplexity), the speed peer of kvc-run (issue 17) and a quality peer (issue 26), under BUILD/peers (`make peers`; never committed, BUILD is git-ignored).
# Prints one line and does nothing when the stamp says it is built with these pins and flags.
#
# The source is the sdist of llama-cpp-python==0.3.36 on PyPI, which vendors llama.cpp (commit
# 0c1e570): fetched with pip download, never installed. The flags are those of
# ../shared/notes/peers.md: Release, GGML_NATIVE=ON, no curl, no OpenSSL, no tests; cmake and ninja
# come from Debian (bench/peers.mk installs cmake and ninja-build when missing). The targets are
# llama-bench, llama-completion and llama-perplexity (llama-bench already builds llama.cpp's common
# library, so each of the others costs a file or two more); LLAMACPP_TARGETS changes them. The
# libraries they share (libllama, libggml*) are what bench/tiers-peers.sh links its scorer against. The first build takes about
# 10 minutes on 2 quiet cores (19 with other builds running).
#
# `--no-binary llama-cpp-python`, not `--no-binary :all:`: pip prepares an sdist's metadata even
# with --no-deps, and under :all: it first builds scikit-build-core and its whole build-dependency
# tree from sources (minutes, for nothing); with only the package named, those come as wheels and
# the download takes seconds. The file fetched is the same sdist.
#
# The Xeons of these machines report AMX, and GGML_NATIVE builds ggml's AMX backend in, which segfaults in
# ggml_backend_amx_mul_mat: run llama-bench with `--repack 0` (the common tools with `-nr`). It
# changes nothing for Q4_1 on x86.
#
# The stamp BUILD/peers/llama.cpp.stamp holds the version, the flags and the targets; it is written
# only after every target built, so an interrupted build is resumed (ninja) on the next run.
set -euo pipefail

VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
TARGETS=${LLAMACPP_TARGETS:-llama-bench llama-completion llama-perplexity}
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_OPENSSL=OFF)
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}

die() {
        echo "get-llamacpp.sh: $*" >&2
        exit 1
}

[ $# -eq 1 ] && [ -n "$1" ] || die "usage: get-llamacpp.sh BUILD"
peers=$1/peers
src=$peers/src/llama_cpp_python-$VERSION
cbuild=$peers/llama.cpp
stamp=$peers/llama.cpp.stamp
want="llama-cpp-python==$VERSION ${CMAKE_FLAGS[*]} targets: $TARGETS"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$cbuild/bin/llama-bench" ]; then
        echo "peers: llama.cpp is built ($cbuild/bin: $TARGETS)"
        exit 0
fi
command -v cmake >/dev/null && command -v ninja >/dev/null || die "cmake and ninja are missing (make peers installs cmake and ninja-build)"

mkdir -p "$peers/src"
if ! [ -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        tmp=$(mktemp -d "$peers/.fetch.XXXXXX")
        trap 'rm -rf "$tmp"' EXIT
        echo "peers: fetching $SDIST (pip download --no-binary llama-cpp-python llama-cpp-python==$VERSION)"
        "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-binary llama-cpp-python --no-deps \
                "llama-cpp-python==$VERSION" -d "$tmp" ||
                die "pip download llama-cpp-python==$VERSION failed (no network to PyPI, or no pip: make deps installs python3-pip)"
        [ -f "$tmp/$SDIST" ] || die "pip download did not produce $SDIST"
        tar -xzf "$tmp/$SDIST" -C "$tmp" || die "cannot unpack $SDIST"
        [ -f "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/CMakeLists.txt" ] ||
                die "$SDIST has no vendor/llama.cpp/CMakeLists.txt"
        rm -rf "$src"
        mv "$tmp/llama_cpp_python-$VERSION" "$src"
        rm -rf "$tmp"
        trap - EXIT
fi

rm -f "$stamp"
echo "peers: building $TARGETS from $src/vendor/llama.cpp into $cbuild (several minutes on 2 cores)"
cmake -S "$src/vendor/llama.cpp" -B "$cbuild" "${CMAKE_FLAGS[@]}" >"$peers/cmake.log" 2>&1 ||
        { tail -20 "$peers/cmake.log" >&2; die "cmake failed (log: $peers/cmake.log)"; }
# shellcheck disable=SC2086
ninja -C "$cbuild" -j "$JOBS" $TARGETS >"$peers/ninja.log" 2>&1 ||
        { tail -20 "$peers/ninja.log" >&2; die "the build failed (log: $peers/ninja.log)"; }
echo "$want" >"$stamp"
echo "peers: llama.cpp is built ($cbuild/bin: $TARGETS)"
