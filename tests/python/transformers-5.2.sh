#!/usr/bin/env bash
# tests/python/transformers-5.2.sh BUILD [PYTEST-ARGS...]: the KvcdCache tests of transformers.sh
# under transformers 5.2, the release kvpress 0.5.5 pins, in BUILD/venv-kvpress (`make
# kvpress-deps`). Fails when that venv holds another transformers than 5.2.x (the pins moved).
set -eu
build=${1:-build}
root=$(cd "$(dirname "$0")/../.." && pwd)
case $build in /*) ;; *) build=$root/$build ;; esac
py=$build/venv-kvpress/bin/python
if [ -x "$py" ]; then
        v=$("$py" -c 'import importlib.metadata as m; print(m.version("transformers"))')
        case $v in
        5.2.*) ;;
        *) echo "transformers-5.2.sh: $py has transformers $v, not 5.2.x" >&2; exit 1 ;;
        esac
fi
KVC_TORCH_VENV=venv-kvpress exec "$root/tests/python/transformers.sh" "$@"
