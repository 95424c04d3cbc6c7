#!/usr/bin/env bash
# comm-bench end to end: correct results for every op x dtype x redop, output formats, and usage
# errors that exit 2 on every rank with nothing on stdout.
#   comm_bench.sh MPIEXEC COMM_BENCH NRANKS
set -u
mpiexec=$1 bench=$2 n=$3
run="$mpiexec -n $n $bench"
. "$(dirname "$0")/../common/check_lib.sh"

# Every op, dtype and reduction, sizes from 0 bytes, checked twice, in place for avg and min.
for dtype in f32 f64 bf16 f16 i32 i64 u8 u16; do
  for redop in sum avg max min; do
    inplace=""; case $redop in avg|min) inplace=--inplace;; esac
    name="--op all -d $dtype -o $redop $inplace"
    out=$($run --op all -b 0 -e 40K -f 5 -n 2 -w 1 -c 2 -d $dtype -o $redop $inplace 2>&1); rc=$?
    if [ $rc -eq 0 ] && grep -q '^# wrong elements: 0$' <<<"$out"; then ok "$name"; else bad "$name (exit $rc)" "$out"; fi
  done
done

# Rows: one per size, the right number of columns, bus factor 2(n-1)/n for allreduce.
out=$($run -b 8 -e 8K -f 4 -n 3 -w 1 2>/dev/null)
rows=$(grep -vc '^#' <<<"$out")
if [ "$rows" = 6 ] && awk '!/^#/ { if (NF != 9) exit 1 }' <<<"$out"; then ok "table rows"; else bad "table rows ($rows)" "$out"; fi
want=$(awk -v n=$n 'BEGIN { printf "%.3f", 2*(n-1)/n }')
if awk -v w=$want '!/^#/ && $7 > 0.1 { r = $8 / $7; if (r < w - 0.02 || r > w + 0.02) exit 1 }' <<<"$out"; then
  ok "busbw factor"; else bad "busbw factor" "$out"; fi

# --async, --time max, root, -i step
$run --op broadcast -r $((n-1)) -b 1K -e 4K -i 1K -n 2 --async --time max >"$tmp/o" 2>&1 \
  && [ "$(grep -vc '^#' "$tmp/o")" = 4 ] && grep -q "^# wrong elements: 0$" "$tmp/o" && ok "broadcast, async, step, root" \
  || bad "broadcast, async, step, root" "$(cat "$tmp/o")"

# JSON: one document on stdout, nothing else there.
$run --op all -e 4K -f 16 -n 2 --json >"$tmp/j" 2>"$tmp/e"
if python3 - "$tmp/j" "$n" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
n = int(sys.argv[2])
assert d["config"]["nranks"] == n and len(d["ranks"]) == n
assert d["wrong"] == 0 and len(d["results"]) == 6 * 3
assert set(d["peak_busbw_gbps"]) == {"allreduce", "allgather", "reducescatter", "broadcast", "alltoall", "sendrecv"}
for r in d["results"]:
    assert r["time_us"] > 0 and r["wrong"] == 0
PY
then ok "json"; else bad "json" "$(cat "$tmp/j" "$tmp/e")"; fi

# --fit: latency + bytes / bandwidth per collective, and predictions (table and JSON).
$run --op all -b 1K -e 256K -f 4 -n 2 -w 1 --fit --predict 4M >"$tmp/o" 2>&1
if [ "$(grep -c '^# fit (' "$tmp/o")" = 6 ] && [ "$(grep -c '^# predicted (' "$tmp/o")" = 6 ] \
   && grep -q '^# fit (allreduce): time = [0-9.]* us + bytes / [0-9.]* GB/s' "$tmp/o"; then ok "--fit table"
else bad "--fit table" "$(cat "$tmp/o")"; fi
$run --op allreduce -b 1K -e 256K -f 4 -n 2 -w 1 --fit --predict 4M,1G --json >"$tmp/j" 2>"$tmp/e"
python3 - "$tmp/j" <<'PY' && ok "--fit json" || bad "--fit json" "$(cat "$tmp/j" "$tmp/e")"
import json, sys
f = json.load(open(sys.argv[1]))["fit"]["allreduce"]
assert f["alpha_us"] >= 0 and f["algbw_gbps"] >= 0 and f["max_rel_err"] >= 0
p = f["predicted"]
assert [x["size"] for x in p] == [4 << 20, 1 << 30] and p[1]["time_us"] >= p[0]["time_us"] > 0
PY

# --config: options from a file.
printf 'op = "reducescatter"\nmax-bytes = "1K"\niters = 2\n' >"$tmp/c.toml"
$run --config "$tmp/c.toml" >"$tmp/o" 2>&1 && grep -q 'reducescatter\|sum' "$tmp/o" && [ "$(grep -vc '^#' "$tmp/o")" = 8 ] \
  && ok "--config" || bad "--config" "$(cat "$tmp/o")"

# --help and --version exit 0.
$bench --help >"$tmp/o" 2>&1 && grep -q -- '--redop' "$tmp/o" && ok "--help" || bad "--help" "$(cat "$tmp/o")"
$bench --version >"$tmp/o" 2>&1 && grep -q 'comm-bench (dtk)' "$tmp/o" && ok "--version" || bad "--version" "$(cat "$tmp/o")"

# Usage errors: exit 2, an explanation on stderr, nothing on stdout.
usage() {
  local pat=$1; shift
  $run "$@" >"$tmp/o" 2>"$tmp/e"; local rc=$?
  if [ $rc -eq 2 ] && [ ! -s "$tmp/o" ] && grep -q -- "$pat" "$tmp/e"; then ok "usage: $*"; else
    bad "usage: $* (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"; fi
}
usage "larger than --max-bytes" -b 1M -e 1K
usage "unknown --op" --op allreduc
usage "unknown dtype" -d f8
usage "unknown reduction" -o prod
usage "not a rank" --op broadcast -r $n
usage "add --device cuda" --backend nccl

# --device cuda: a usage error where this comm-bench has no GPU to use (no CUDA backend, or none
# visible: --version says which), else a checked run on GPU buffers (NCCL where every rank has a
# GPU of its own, else MPI staging).
$bench --version >"$tmp/v" 2>&1
if grep -q 'GPUs visible: 0' "$tmp/v"; then
  usage "sees no GPU\|without the CUDA backend" --device cuda
else
  gpus=$(sed -n 's/.*GPUs visible: \([0-9]*\).*/\1/p' "$tmp/v")
  backend=mpi; [ "$n" -le "$gpus" ] && backend=auto
  $run --device cuda --backend $backend --op all -b 8 -e 64K -f 8 -n 2 -w 1 -c 2 -d bf16 >"$tmp/o" 2>&1 \
    && grep -q '^# wrong elements: 0$' "$tmp/o" && ok "--device cuda ($gpus GPUs, --backend $backend)" \
    || bad "--device cuda ($gpus GPUs, --backend $backend)" "$(cat "$tmp/o")"
fi
grep -q '^CUDA: .*; NCCL: ' "$tmp/v" && ok "--version names the CUDA backend, NCCL and the GPUs" \
  || bad "--version" "$(cat "$tmp/v")"
usage "bad size" -e 12Q
usage "step-factor" -f 1
usage "excludes" -f 2 -i 1K
usage "comm-bench: error: --iters must be at least 1" --iters 0
usage "needs --fit" --predict 1M

finish
