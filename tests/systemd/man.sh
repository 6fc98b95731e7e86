#!/bin/sh
# man.sh: the manual pages say what the programs say. Every long option that `kvcd --help`
# prints is in man/kvcd.8; every option of `kvc-run --help` is in man/kvc-run.1, of `kvc-eval
# --help` in man/kvc-eval.1, of `kvc-load --help` in man/kvc-load.1; every verb and option of
# `kvcctl --help` is in man/kvcctl.1. Every program `make install` installs has its page. The pages are compared after roff's escapes are
# taken out (\- is a hyphen, \fB..\fR are fonts). When groff is installed, each page must also
# format with `groff -man -ww -z` without a single warning.
# Usage: tests/systemd/man.sh [BUILD]   (default build)
set -eu
build=${1:-build}
here=$(cd "$(dirname "$0")/../.." && pwd)
case "$build" in /*) ;; *) build=$(pwd)/$build ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

checked=0
missing=0

# help PROGRAM: its --help text in $tmp/PROGRAM.help
help() {
        if [ ! -x "$build/bin/$1" ]; then
                echo "man: $build/bin/$1 is missing (build it first)"
                exit 1
        fi
        "$build/bin/$1" --help >"$tmp/$1.help"
}

# page FILE: the page with roff's escapes taken out, in $tmp/page
page() {
        sed -e 's/\\-/-/g' -e 's/\\f[BIRP]//g' -e 's/\\&//g' -e 's/\\(lq/"/g' -e 's/\\(rq/"/g' \
                "$here/$1" >"$tmp/page"
}

# options PROGRAM: every long option in its help, and the short ones that start a line
options() {
        {
                grep -o -- '--[a-z][a-z0-9-]*' "$tmp/$1.help" || true
                sed -n 's/^ *\(-[A-Za-z]\)[ ,].*/\1/p' "$tmp/$1.help"
        } | sort -u
}

# expect PAGE WHAT REGEX: counts a check, reports a miss
expect() {
        checked=$((checked + 1))
        if ! grep -Eq -- "$3" "$tmp/page"; then
                echo "man: $1 does not mention $2"
                missing=$((missing + 1))
        fi
}

# check_options PROGRAM PAGE
check_options() {
        for opt in $(options "$1"); do
                expect "$2" "$opt" "(^|[^A-Za-z0-9-])$opt([^A-Za-z0-9-]|\$)"
        done
}

help kvcd
help kvc-run
help kvc-eval
help kvc-load
help kvcctl

page man/kvcd.8
check_options kvcd man/kvcd.8

page man/kvc-run.1
check_options kvc-run man/kvc-run.1

page man/kvc-eval.1
check_options kvc-eval man/kvc-eval.1

page man/kvc-load.1
check_options kvc-load man/kvc-load.1

page man/kvcctl.1
check_options kvcctl man/kvcctl.1
# verbs: the lines of the Verbs: block that start with a word (or two: "budget get"); a verb
# must begin a line of the page, alone or after a font request (.B status, .BI evict ...)
sed -n '/^Verbs:/,/^$/p' "$tmp/kvcctl.help" | sed -n 's/^  \([a-z][a-z]*\( [a-z][a-z]*\)\{0,1\}\)\( .*\)\{0,1\}$/\1/p' \
        >"$tmp/verbs"
if [ ! -s "$tmp/verbs" ]; then
        echo "man: no verbs found in kvcctl --help"
        exit 1
fi
while IFS= read -r verb; do
        expect man/kvcctl.1 "the verb $verb" "^(\\.[A-Z]+ +)?\"?$verb([ \"]|\$)"
done <"$tmp/verbs"

groff_note="groff not installed: formatting not checked"
if command -v groff >/dev/null 2>&1; then
        groff_note="groff -ww clean"
        for p in man/kvcd.8 man/kvc-run.1 man/kvc-eval.1 man/kvc-load.1 man/kvcctl.1; do
                checked=$((checked + 1))
                if ! out=$(groff -man -ww -z "$here/$p" 2>&1) || [ -n "$out" ]; then
                        echo "man: groff warns about $p:"
                        printf '%s\n' "$out"
                        missing=$((missing + 1))
                        groff_note="groff warnings"
                fi
        done
fi

if [ "$missing" -ne 0 ]; then
        echo "man: $missing of $checked checks failed ($groff_note)"
        exit 1
fi
echo "man: $checked checks passed: every option and verb of --help is in its page ($groff_note)"
