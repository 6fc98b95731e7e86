#!/usr/bin/env bash
# tests/fuzz/get-protobuf-c.sh DIR: puts Debian bookworm's protobuf-c 1.4.1 source (the version
# whose headers the build uses) under DIR/protobuf-c-1.4.1, so the fuzzers can compile its parser
# with coverage (tests/fuzz/fuzz.mk). Nothing on the system changes: apt-get runs with a private
# source list and state directory under DIR. The tarball's checksum is the one in Debian's .dsc.
# A tarball already at hand can be given as $PROTOBUF_C_TARBALL. Exits 0 when the source is there.
set -euo pipefail
dir=$1
want=4cc4facd508172f3e0a4d3a8736225d472418aee35b4ad053384b137b220339f
tarball=protobuf-c_1.4.1.orig.tar.gz
[ -f "$dir/protobuf-c-1.4.1/protobuf-c/protobuf-c.c" ] && exit 0
mkdir -p "$dir/apt/lists/partial" "$dir/apt/parts"
cd "$dir"
if [ -n "${PROTOBUF_C_TARBALL:-}" ]; then
        cp "$PROTOBUF_C_TARBALL" "$tarball"
elif [ ! -f "$tarball" ]; then
        cat >apt/parts/debian-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
        opts=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$PWD/apt/parts"
                -o Dir::State::Lists="$PWD/apt/lists" -o Debug::NoLocking=1)
        timeout 120 apt-get -qq "${opts[@]}" update >/dev/null 2>&1 &&
                timeout 120 apt-get -qq "${opts[@]}" source --download-only protobuf-c=1.4.1-1 \
                        >/dev/null 2>&1 || { echo "get-protobuf-c: cannot download the source" >&2; exit 1; }
fi
if ! echo "$want  $tarball" | sha256sum -c --quiet -; then
        echo "get-protobuf-c: checksum mismatch" >&2
        rm -f "$tarball"
        exit 1
fi
tar xzf "$tarball" protobuf-c-1.4.1/protobuf-c/protobuf-c.c protobuf-c-1.4.1/protobuf-c/protobuf-c.h \
        protobuf-c-1.4.1/LICENSE
cmp -s protobuf-c-1.4.1/protobuf-c/protobuf-c.h /usr/include/protobuf-c/protobuf-c.h ||
        echo "get-protobuf-c: note: the system's protobuf-c.h differs from 1.4.1's" >&2
