# Sourced by the end-to-end tests of the training programs: check_lib.sh (result counting, the
# scratch directory, here the working directory), a small llama that trains in seconds on two
# cores, and run/expect2 helpers.
. "$(dirname "${BASH_SOURCE[0]}")/check_lib.sh"
cd "$tmp"
small="--model llama-tiny --dim 32 --layers 2 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 64 --seq-len 16"
# One run reached two ways (another world size, sharded optimizer state, another bucket plan):
# the same weights up to f32 summation order, which AdamW's m / sqrt(v) magnifies where v is
# small. Measured (shard-inspect diff's smallest passing rtol at atol 1e-6, on $small at lr 1e-2):
# fsdp_train.sh's 20 AdamW steps against psgd-train at most 1.8e-5 on 4 ranks, psgd_train.sh's
# 6 steps on 4 ranks against 1 at most 3.2e-5 (RelWithDebInfo); the ASan + UBSan build was seen
# above 1e-4 (issue 31: 1 tensor of 64). A 1% change of lr moves the same 20 steps by up to
# 6.6e-3 and passes at no rtol below 0.1: fsdp_train.sh checks that it still fails this.
same_run="--rtol 1e-3 --atol 1e-6"
# Runs a command: $rc its exit status, $tmp/o its stdout, $tmp/e its stderr.
run() { "$@" >"$tmp/o" 2>"$tmp/e"; rc=$?; }
# Bad input: exit 2 (on every rank), the message on stderr, nothing on stdout.
expect2() {
  local name=$1 msg=$2; shift 2
  run "$@"
  if [ $rc = 2 ] && grep -q -- "$msg" "$tmp/e" && [ ! -s "$tmp/o" ]; then ok "bad input: $name"
  else bad "bad input: $name (exit $rc)" "$(cat $tmp/e)"; fi
}
