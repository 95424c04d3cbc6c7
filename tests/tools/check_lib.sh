# Sourced by the end-to-end test scripts: result counting (ok, bad, finish) and a scratch
# directory $tmp, removed at exit.
pass=0 fail=0
ok() { echo "ok   $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1"; shift; printf '%s\n' "$@" | tail -25; fail=$((fail+1)); }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
finish() { echo "$pass passed, $fail failed"; [ $fail = 0 ]; }
