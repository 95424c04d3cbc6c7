#!/usr/bin/env bash
# psgd-train --compressor auto end to end: it measures the link (loopback) and plans from it; on a
# fast link it chooses none; on a slow one (DTK_AUTO_LINK, the documented testing aid that
# replaces the measured link model: CI has no netlab) it compresses, and Accordion's rule lowers
# the rank after the first (critical) interval; a resume continues exactly (choices, Accordion history, the sub-compressors' error and Q);
# options that do not fit exit 2 on every rank.
#   psgd_auto.sh MPIEXEC PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 si=$3
common="$small --data synthetic --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn"
auto="--compressor auto --start-iter 3 --auto-interval 4 --bucket-size 20KB"
slow="-x DTK_AUTO_LINK=50,0.0000125"  # 100 kbit/s, 50 us: a bucket of 20 KB takes 1.6 s, far above any backward on loaded cores

# choices: the plan's per-bucket choices (--print-plan's JSON on stdout), one word each
choices() { python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); print(" ".join(b["choice"] for b in p["buckets"]))' "$tmp/o"; }

fast="-x DTK_AUTO_LINK=1,100"     # 1 us, 100 GB/s: nothing for compression to win

# ---- the measured link (loopback): timed all-reduces, and a plan the model stands behind. What it
# chooses is the machine's: idle, loopback chose none; on CI's loaded 2 cores it once measured
# 0.17 GB/s and rightly compressed 3 buckets of 4, so the choice itself is checked on a fast link
# (--steps 1: --print-plan runs to the plan whatever --steps says) ----
run $mpiexec -n 2 $psgd $common $auto --print-plan --steps 1
if [ $rc = 0 ] && c=$(choices) && [ -n "$c" ] && python3 -c '
import json, math, sys
p = json.load(open(sys.argv[1])); l, q = p["link"], p["predicted"]
# algbw 0: unbounded, a latency-only fit (comm::fit_cost takes it when noise makes the slope
# negative, as 4 ranks on a loaded machine once did)
assert l["source"] == "measured" and l["alpha_us"] > 0 and 0 <= l["algbw_gbps"] < math.inf, l
assert q["step_ms"] <= q["none_step_ms"], q  # the first plan leaves none only for a predicted gain
assert all(b["choice"] in ("none", "powersgd") for b in p["buckets"])' "$tmp/o"; then
  ok "measured link: $(python3 -c 'import json,sys; l=json.load(open(sys.argv[1]))["link"]; print("%.1f us + %.3g GB/s" % (l["alpha_us"], l["algbw_gbps"]))' "$tmp/o"), plan: $c"
else bad "measured-link plan (exit $rc): ${c:-}" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi

# ---- a fast link: none everywhere ----
run $mpiexec $fast -n 2 $psgd $common $auto --print-plan --steps 1
if [ $rc = 0 ] && c=$(choices) && [ -n "$c" ] && [ -z "$(echo $c | tr -d ' ' | sed 's/none//g')" ]; then
  ok "fast link: auto chooses none for every bucket ($(echo $c | wc -w) buckets)"
else bad "fast-link plan (exit $rc): ${c:-}" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi

# ---- a slow link: PowerSGD ----
run $mpiexec $slow -n 2 $psgd $common $auto --print-plan
if [ $rc = 0 ] && c=$(choices) && [ -z "$(echo $c | tr -d ' ' | sed 's/powersgd//g')" ] &&
   python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); assert p["link"]["source"]=="DTK_AUTO_LINK"; assert p["predicted"]["step_ms"] < p["predicted"]["none_step_ms"]' "$tmp/o"; then
  ok "slow link: auto compresses every bucket"
else bad "slow-link plan (exit $rc): ${c:-}" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi

# ---- the run: plain steps, then the high rank (the first interval is critical), then the low one;
# the bytes follow; the metrics carry the ranks ----
run $mpiexec $slow -n 2 $psgd $common $auto --steps 12 --metrics slow.jsonl
if [ $rc = 0 ] && python3 - slow.jsonl <<'PY'; then ok "slow link: ranks 0 -> 4 (critical) -> 1 where regular, bytes shrink"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ranks = [r["compress_ranks"] for r in rows]
# plain steps; the first interval is critical (high rank everywhere); then each bucket by its own
# regime (llama's early gradients change fast: some stay critical), at least one regular
assert all(set(x) == {0} for x in ranks[:3]) and all(set(x) == {4} for x in ranks[3:7]), ranks
assert all(set(x) <= {1, 4} for x in ranks[7:]) and any(1 in x for x in ranks[7:]), ranks
b = [r["comm_bytes"] for r in rows]
assert b[0] > b[3] > min(b[7:]), b
PY
else bad "slow-link run (exit $rc)" "$(cat $tmp/e)" "$(cat slow.jsonl 2>/dev/null | tail -3)"; fi

# ---- resume: 16 steps == 8 + resume + 8, bit for bit (a rank change at step 8, another at 12) ----
rm -f a.jsonl b.jsonl
run $mpiexec $slow -n 2 $psgd $common $auto --steps 16 --save full.h5 --metrics a.jsonl
[ $rc = 0 ] || bad "resume: uninterrupted run (exit $rc)" "$(cat $tmp/e)"
rm -rf ck; run $mpiexec $slow -n 2 $psgd $common $auto --steps 16 --stop-at 8 --checkpoint-dir ck --metrics b.jsonl
[ $rc = 0 ] || bad "resume: first half (exit $rc)" "$(cat $tmp/e)"
run $mpiexec $slow -n 2 $psgd $common $auto --steps 16 --resume ck --save resumed.h5 --metrics b.jsonl
[ $rc = 0 ] || bad "resume: second half (exit $rc)" "$(cat $tmp/e)"
# everything but auto/costs and auto/overhead (measured times, as they came out of each run)
run $si diff full.h5 resumed.h5 model/ optim/ ranks/0/compress/error/ ranks/1/compress/error/ ranks/0/compress/auto/accordion \
  ranks/1/compress/auto/accordion compress/q/ compress/step compress/auto/choice --rtol 0 --atol 0
strip() { python3 -c 'import json,sys; [print(json.dumps({k: r[k] for k in ("step","loss","grad_norm","comm_bytes","compress_ranks")})) for r in map(json.loads, open(sys.argv[1]))]' "$1"; }
if [ $rc = 0 ] && cmp -s <(strip a.jsonl) <(strip b.jsonl); then ok "auto: resume is exact (weights, optimizer, compressor state, losses)"
else bad "auto: resume differs (diff exit $rc)" "$(cat $tmp/o | tail -5)" "$(diff <(strip a.jsonl) <(strip b.jsonl))"; fi

# ---- options that do not fit: exit 2 on every rank ----
expect2 "auto with --rank" "auto chooses the rank itself" $mpiexec -n 2 $psgd $common --compressor auto --rank 2 --steps 2
expect2 "--print-plan without auto (nor Shampoo)" "makes a plan with --compressor auto" $mpiexec -n 2 $psgd $common --compressor powersgd --print-plan
expect2 "--auto-ranks HIGH,LOW" "auto_ranks must be two ranks" $mpiexec -n 2 $psgd $common --compressor auto --auto-ranks 4,1 --steps 2
expect2 "a bad DTK_AUTO_LINK" "DTK_AUTO_LINK='fast'" $mpiexec -x DTK_AUTO_LINK=fast -n 2 $psgd $common $auto --steps 5
finish
