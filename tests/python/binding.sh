#!/usr/bin/env bash
# tests/python/binding.sh BUILD: the pytest suite of the kvcd Python package (client/python/tests)
# against the build tree's kvcd, kvcctl and libkvc, with the venv `make pydeps` made in BUILD/venv.
# Installs nothing: the package is imported from the source tree (PYTHONPATH), libkvc named by
# KVC_LIBRARY. One entry in tests/run.sh's summary: passes when every test passes.
set -eu
build=${1:-build}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
case $build in /*) ;; *) build=$root/$build ;; esac
py=$build/venv/bin/python
if [ ! -x "$py" ]; then
        echo "binding.sh: $py missing: run make pydeps BUILD=$build" >&2
        exit 1
fi
export KVC_BUILD=$build
export KVC_LIBRARY=$build/lib/libkvc.so
export KVCCTL=$build/bin/kvcctl
export PYTHONPATH=$root/client/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
unset KVC_SOCKET
exec "$py" -m pytest -q -p no:cacheprovider client/python/tests
