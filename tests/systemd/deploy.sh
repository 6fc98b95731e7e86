#!/bin/sh
# deploy.sh: the fleet files of deploy/ are well formed: kvcd.service with the events drop-in
# (deploy/systemd/kvcd-events.conf) passes `systemd-analyze verify` with nothing to say, the drop-in
# starts kvcd with the events options kvcd accepts, the Kubernetes manifests parse as YAML
# (BUILD/venv's PyYAML) with the kinds docs/operations.md describes, and the reference router
# compiles. Usage: tests/systemd/deploy.sh [BUILD]   (default build)
set -eu
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
py=$build/venv/bin/python
[ -x "$py" ] || { echo "deploy.sh: $py is missing: run make pydeps BUILD=$build"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$here"/systemd/kvcd.service "$here"/systemd/kvcd.socket "$here"/systemd/kvcd-admin.socket "$tmp"/
mkdir "$tmp"/kvcd.service.d
cp "$here"/deploy/systemd/kvcd-events.conf "$tmp"/kvcd.service.d/events.conf
sed -i "s|/usr/local/bin/kvcd|$build/bin/kvcd|" "$tmp"/kvcd.service "$tmp"/kvcd.service.d/events.conf
out=$(cd "$tmp" && SYSTEMD_UNIT_PATH="$tmp": systemd-analyze verify --man=no ./kvcd.service 2>&1) || {
        echo "systemd-analyze verify failed:"; echo "$out"; exit 1; }
if [ -n "$out" ]; then
        echo "systemd-analyze verify has warnings:"; echo "$out"; exit 1
fi
# the drop-in's command line, with the variables of events.env, is one kvcd accepts: --help
# after the options makes kvcd parse them all and exit 0 without starting
. "$here"/deploy/systemd/events.env
args=$(sed -n '/^ExecStart=./,/[^\\]$/p' "$tmp"/kvcd.service.d/events.conf | sed -e 's/^ExecStart=//' -e 's/\\$//' |
        tr '\n\t' '  ' | sed "s|\${KVCD_EVENTS_ADDR}|$KVCD_EVENTS_ADDR|g")
# shellcheck disable=SC2086
$args --help >/dev/null || { echo "deploy.sh: kvcd refuses the drop-in's options: $args"; exit 1; }
echo "systemd drop-in: clean"
"$py" - "$here"/deploy/kubernetes/kvcd-daemonset.yaml <<'PYEOF'
import sys, yaml
docs = list(yaml.safe_load_all(open(sys.argv[1])))
kinds = [d["kind"] for d in docs]
assert kinds == ["Namespace", "DaemonSet", "Service", "NetworkPolicy", "Pod"], kinds
ds = docs[1]["spec"]["template"]["spec"]
args = ds["containers"][0]["args"]
assert "--events-format=vllm" in args and any(a.startswith("--events-endpoint=tcp://") for a in args)
assert ds["volumes"][0]["hostPath"]["path"] == "/run/kvcd"
print("kubernetes manifests: %s" % ", ".join(kinds))
PYEOF
"$py" -c "import ast, sys; ast.parse(open(sys.argv[1]).read())" "$here"/deploy/router/kv_router_index.py
echo "router: compiles"
