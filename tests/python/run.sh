#!/usr/bin/env bash
# tests/python/run.sh BUILD: the pytest tests of tests/python (test_*.py) with BUILD/venv's
# python (`make pydeps`: pytest, msgspec, pyzmq pinned in tests/python/requirements.txt), against
# the binaries of BUILD. tests/run.sh counts it as one test. A missing venv or binary is a
# failure, not a skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
for f in "$build/venv/bin/python" "$build/bin/kvcd" "$build/bin/kvc-run"; do
        [ -x "$f" ] || { echo "tests/python/run.sh: $f is missing: run make pydeps all BUILD=$build" >&2; exit 1; }
done
export KVC_BUILD=$build
exec "$build/venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests/python
