# Sourced by the end-to-end test scripts: result counting (ok, bad, finish) and a scratch
# directory $tmp, removed at exit.
pass=0 fail=0
ok() { echo "ok   $1"; pass=$((pass+1)); }
bad() { echo "FAIL $1"; shift; printf '%s\n' "$@" | tail -25; fail=$((fail+1)); }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
finish() { echo "$pass passed, $fail failed"; [ $fail = 0 ]; }
# programs BUILD_DIR [binary|script]: the programs, one a line, from the one list
# (tools/CMakeLists.txt; CMake writes it to BUILD_DIR/programs.txt): all, or those of one kind.
programs() {
  [ -s "$1/programs.txt" ] || { echo "no $1/programs.txt (configure the build first)" >&2; return 1; }
  awk -v k="${2:-}" 'k == "" || $2 == k { print $1 }' "$1/programs.txt"
}
