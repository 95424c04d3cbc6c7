# Sourced by the end-to-end tests of the training programs: check_lib.sh (result counting, the
# scratch directory, here the working directory), a small llama that trains in seconds on two
# cores, and run/expect2 helpers.
. "$(dirname "${BASH_SOURCE[0]}")/check_lib.sh"
cd "$tmp"
small="--model llama-tiny --dim 32 --layers 2 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 64 --seq-len 16"
# Runs a command: $rc its exit status, $tmp/o its stdout, $tmp/e its stderr.
run() { "$@" >"$tmp/o" 2>"$tmp/e"; rc=$?; }
# Bad input: exit 2 (on every rank), the message on stderr, nothing on stdout.
expect2() {
  local name=$1 msg=$2; shift 2
  run "$@"
  if [ $rc = 2 ] && grep -q -- "$msg" "$tmp/e" && [ ! -s "$tmp/o" ]; then ok "bad input: $name"
  else bad "bad input: $name (exit $rc)" "$(cat $tmp/e)"; fi
}
