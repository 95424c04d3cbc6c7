#!/usr/bin/env bash
# comm-bench end to end: correct results for every op x dtype x redop, output formats, the
# per-iteration times (table columns, --iters-json) and the straggler report under an injected
# delay, and usage errors that exit 2 on every rank with nothing on stdout.
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
if [ "$rows" = 6 ] && awk '!/^#/ { if (NF != 13) exit 1 }' <<<"$out"; then ok "table rows"; else bad "table rows ($rows)" "$out"; fi
want=$(awk -v n=$n 'BEGIN { printf "%.3f", 2*(n-1)/n }')
if awk -v w=$want '!/^#/ && $7 > 0.1 { r = $8 / $7; if (r < w - 0.02 || r > w + 0.02) exit 1 }' <<<"$out"; then
  ok "busbw factor"; else bad "busbw factor" "$out"; fi

# Per-iteration columns after #wrong ($10-$13: min, median, p99, max of the iterations, each its
# slowest rank's time), in order; the time (the mean over ranks of each rank's mean) is at most
# the max, and on one rank (the iterations are that rank's) at least the min. On more ranks the
# mean over ranks can fall below the min (the slowest rank changes from one iteration to the
# next): --iters-json's check below ties the columns to the iterations exactly.
order='!/^#/ { if (!($10 <= $11 && $11 <= $12 && $12 <= $13 && $6 <= $13 && (n > 1 || $10 <= $6))) exit 1 }'
if awk -v n=$n "$order" <<<"$out"; then ok "per-iteration columns in order"
else bad "per-iteration columns in order" "$out"; fi

# --iters-json (with --json): every size's iterations x ranks, written atomically (nothing else
# left in the directory); the table's time is their mean over ranks and iterations, and min,
# median, p99, max those of the iterations' slowest ranks; 0 us before each call without a delay.
mkdir "$tmp/it"
$run --op all -b 8 -e 4K -f 16 -n 5 -w 1 --json --iters-json "$tmp/it/iters.json" >"$tmp/j" 2>"$tmp/e"
if [ "$(ls -A "$tmp/it")" = iters.json ] && python3 - "$tmp/j" "$tmp/it/iters.json" "$n" <<'PY'
import json, sys
d, it, n = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
assert it["program"] == "comm-bench" and it["config"] == d["config"] and it["ranks"] == d["ranks"]
assert it["config"]["iters"] == 5 and it["config"]["delay"] is None
rows, its = d["results"], it["results"]
assert len(rows) == len(its) == 6 * 3, (len(rows), len(its))
def q(v, p):  # numpy's default (linear) quantile, as comm-bench computes it
    v = sorted(v); x = p * (len(v) - 1); i = int(x)
    return v[-1] if i + 1 >= len(v) else v[i] + (x - i) * (v[i + 1] - v[i])
close = lambda a, b: abs(a - b) <= 0.002 + 1e-6 * abs(b)
for r, i in zip(rows, its):
    assert (i["op"], i["size"], i["count"]) == (r["op"], r["size"], r["count"])
    t, b = i["time_us"], i["before_call_us"]
    assert len(t) == len(b) == 5 and all(len(x) == n for x in t + b), i
    assert all(v == 0 for x in b for v in x) and all(v > 0 for x in t for v in x)
    assert close(sum(map(sum, t)) / (5 * n), r["time_us"]), (r, i)
    slowest = [max(x) for x in t]
    for key, p in (("time_min_us", 0), ("time_median_us", 0.5), ("time_p99_us", 0.99), ("time_max_us", 1)):
        assert close(q(slowest, p), r[key]), (key, r, i)
    assert (r["last_to_arrive"] is None) == (n == 1 or r["op"] == "broadcast"), r
PY
then ok "--iters-json: schema, counts, the table's columns"; else bad "--iters-json" "$(ls -A "$tmp/it"; cat "$tmp/j" "$tmp/e")"; fi

# The straggler report: rank 1 (neither first nor last of 4) made 50 ms late before each timed
# iteration is named, as a straggler, at every size of every operation where everyone waits
# (table and JSON); broadcast's root waits for no one: not inferred. On one rank no report.
# Lateness is counted from the rank before it in arrival order, which on oversubscribed cores can
# itself be descheduled: at least 45 ms (CI once measured 49.2 ms).
delay=DTK_COMM_BENCH_DELAY_RANK
if [ "$n" -gt 1 ]; then
  env $delay=1:50000 $run --op allreduce -b 1K -e 2K -n 20 -w 1 >"$tmp/o" 2>&1
  want='^# straggler (allreduce) \(1024\|2048\) B: rank 1, last to arrive in \(1[89]\|20\)/20 iterations (p [0-9.e-]*), \(4[5-9]\|5[0-9]\)[0-9]\{3\}\.[0-9]* us late (median; [0-9.]*% of the median time)$'
  if [ "$(grep -c "$want" "$tmp/o")" = 2 ] && grep -q "^# $delay: rank 1 sleeps 50000 us" "$tmp/o"; then
    ok "straggler named in the table, rank 1 of $n"; else bad "straggler in the table, rank 1 of $n" "$(cat "$tmp/o")"; fi
  env $delay=1:50000 $run --op all -b 1K -e 1K -n 20 -w 1 --json >"$tmp/j" 2>"$tmp/e"
  python3 - "$tmp/j" "$n" <<'PY' && ok "straggler named in --json, every operation, rank 1 of $n" \
    || bad "straggler in --json, rank 1 of $n" "$(cat "$tmp/j" "$tmp/e")"
import json, sys
d, n = json.load(open(sys.argv[1])), int(sys.argv[2])
assert d["config"]["delay"] == {"rank": 1, "us": 50000}
for r in d["results"]:
    a = r["last_to_arrive"]
    if r["op"] == "broadcast":
        assert a is None, r
        continue
    # sendrecv's ring: the lateness reaches the rank before the late one after n - 2 iterations
    least = 18 if r["op"] != "sendrecv" else 18 - (n - 2)
    assert a["rank"] == 1 and a["iterations"] >= least and a["of"] == 20 and a["straggler"], r
    assert a["p"] < 1e-3 and 45000 < a["late_us"] < r["time_median_us"] + 1, r
    assert r["time_min_us"] >= 50000, r  # every iteration waits for the delayed rank's sleep
PY
  grep -q '^# straggler (broadcast): not inferred' <(env $delay=1:1000 $run --op broadcast -e 8 -n 2 2>&1) \
    && ok "broadcast: not inferred" || bad "broadcast: not inferred"
else
  env $delay=0:1000 $run -b 8 -e 64 -n 3 >"$tmp/o" 2>&1
  grep -q '^# straggler' "$tmp/o" && bad "one rank: a straggler report" "$(cat "$tmp/o")" || ok "one rank: no straggler report"
fi

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
   && grep -q '^# fit (allreduce): time = -\?[0-9.]* us + bytes / [0-9.]* GB/s' "$tmp/o"; then ok "--fit table"
else bad "--fit table" "$(cat "$tmp/o")"; fi
$run --op allreduce -b 1K -e 256K -f 4 -n 2 -w 1 --fit --predict 4M,1G --json >"$tmp/j" 2>"$tmp/e"
python3 - "$tmp/j" <<'PY' && ok "--fit json" || bad "--fit json" "$(cat "$tmp/j" "$tmp/e")"
import json, sys
f = json.load(open(sys.argv[1]))["fit"]["allreduce"]
assert (f["alpha_us"] >= 0 or f["knee_bytes"] > 0) and f["algbw_gbps"] >= 0 and f["max_rel_err"] >= 0
assert (f["knee_bytes"] == 0) == ("below" not in f), f
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

# --iters-json where it cannot be written, and a bad delay: exit 2 before any collective, said by
# every rank (--log-all-ranks), nothing written.
every_rank() {
  local pat=$1; shift
  $run "$@" --log-all-ranks >"$tmp/o" 2>"$tmp/e"; local rc=$? said=0 r
  for ((r = 0; r < n; r++)); do grep -F -- "[comm-bench $r]" "$tmp/e" | grep -qF -- "$pat" && said=$((said+1)); done
  if [ $rc -eq 2 ] && [ $said = "$n" ] && [ ! -s "$tmp/o" ]; then ok "every rank: $*"
  else bad "every rank: $* (exit $rc, $said of $n ranks said it)" "$(cat "$tmp/o" "$tmp/e")"; fi
}
every_rank "--iters-json $tmp/nodir/i.json: the directory $tmp/nodir does not exist" --iters-json "$tmp/nodir/i.json"
every_rank "--iters-json $tmp: is a directory, not a file" --iters-json "$tmp"
touch "$tmp/afile"
every_rank "--iters-json $tmp/afile/i.json: $tmp/afile is not a directory" --iters-json "$tmp/afile/i.json"
[ ! -e "$tmp/nodir" ] && ! ls -A "$tmp" | grep -q tmp && ok "--iters-json: nothing written on refusal" \
  || bad "--iters-json: something written on refusal"
usage "does not fit --async --device cuda" --iters-json "$tmp/i.json" --async --device cuda
DTK_COMM_BENCH_DELAY_RANK=1:x usage "DTK_COMM_BENCH_DELAY_RANK=1:x: expected RANK:MICROSECONDS" -n 2
DTK_COMM_BENCH_DELAY_RANK=$n:10 usage "rank $n is not a rank of this job of $n" -n 2
DTK_COMM_BENCH_DELAY_RANK=0:-5 usage "expected RANK:MICROSECONDS" -n 2

finish
