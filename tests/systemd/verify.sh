#!/bin/sh
# verify.sh: the unit files pass `systemd-analyze verify` with nothing to say (it exits 0 even on
# the "ignoring" warnings, so any output fails), and their exposure stays "OK" (at most 2.0).
# ExecStart= is pointed at the binary just built, as the units' checks need it to exist.
# Usage: tests/systemd/verify.sh [BUILD]   (default build)
set -eu
build=$(cd "${1:-build}" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$here"/systemd/kvcd.service "$here"/systemd/kvcd.socket "$here"/systemd/kvcd-admin.socket "$tmp"/
sed -i "s|^ExecStart=/usr/local/bin/kvcd|ExecStart=$build/bin/kvcd|" "$tmp"/kvcd.service
cd "$tmp"
out=$(systemd-analyze verify --man=no ./kvcd.socket ./kvcd-admin.socket ./kvcd.service 2>&1) || {
        echo "systemd-analyze verify failed:"; echo "$out"; exit 1; }
if [ -n "$out" ]; then
        echo "systemd-analyze verify has warnings:"; echo "$out"; exit 1
fi
echo "verify: clean"
sec=$(systemd-analyze security --offline=yes --threshold=20 ./kvcd.service 2>&1) || {
        echo "$sec" | tail -3; echo "exposure above 2.0"; exit 1; }
echo "$sec" | tail -1
# the sysusers and tmpfiles snippets hold what the units rely on
grep -q '^u kvcd ' "$here"/systemd/kvcd.sysusers
grep -q '^g kvcd-admin ' "$here"/systemd/kvcd.sysusers
grep -q '^d /run/kvcd 0750 kvcd kvcd' "$here"/systemd/kvcd.tmpfiles
echo "units: ok"
