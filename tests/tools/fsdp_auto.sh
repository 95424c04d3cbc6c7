#!/usr/bin/env bash
# fsdp-train --replicate R --compressor auto (issue 33): auto on HSDP's replica hop. It plans from
# the measured link (loopback); on a fast link it chooses none and the run is today's HSDP bit for
# bit; on a slow link (DTK_AUTO_LINK, the
# testing aid: CI has no netlab) it compresses, sending what fsdp's PowerSGD sends at the chosen
# rank, and Accordion lowers the rank; its decisions and the run do not depend on the shard count
# (2x1 == 2x2); a resume is exact on the same R x S and continues the run on another; misfits
# exit 2 on every rank.
#   fsdp_auto.sh MPIEXEC FSDP_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 fsdp=$2 si=$3
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn --param-dtype f32 --reduce-dtype f32"
auto="--compressor auto --start-iter 3 --auto-interval 4"
# 1 kbit/s, 50 us: the smallest bucket's 2 KB (on 2 x 4) take 17 s, so no backward here hides a
# plain all-reduce. Slower costs nothing (the link is only the model's), and faster ones were hidden:
# at 10 Mbit/s on 8 ranks of 2 loaded cores, and at 100 kbit/s on CI's (stop 56: the resume on 2 x 4
# chose otherwise at step 11). The model takes the step's measured timeline: buckets ready at 10 ms
# and a backward that ends 0.8 s later (a rank descheduled) hide bucket 1's plain all-reduce at
# 100 kbit/s (8% faster than compressing it); at 1 kbit/s no backward under 22 s hides any.
slow="-x DTK_AUTO_LINK=50,0.000000125"
# the compressor's per-bucket choices in --print-plan's JSON (stdout), one word each
choices() { python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); print(" ".join(b["choice"] for b in p["compressor"]["buckets"]))' "$tmp/o"; }
# the metrics that must agree between two runs of the same steps
strip() { python3 -c 'import json,sys; [print(json.dumps({k: r[k] for k in ("step","loss","grad_norm","comm_bytes","compress_ranks")})) for r in map(json.loads, open(sys.argv[1]))]' "$1"; }

# ---- the measured link (loopback): a plan the model stands behind (what it chooses is the
# machine's: idle, none; CI's loaded cores once measured loopback at 0.17 GB/s, and psgd's auto
# rightly compressed), then on a fast link none, and today's HSDP bit for bit (--steps 1:
# --print-plan runs to auto's first plan whatever --steps says) ----
fast="-x DTK_AUTO_LINK=1,100"  # 1 us, 100 GB/s: nothing for compression to win
run $mpiexec -n 4 $fsdp $common $auto --replicate 2 --print-plan --steps 1
if [ $rc = 0 ] && python3 -c '
import json, math, sys
p = json.load(open(sys.argv[1])); c = p["compressor"]; l, q = c["link"], c["predicted"]
# algbw 0: unbounded, a latency-only fit (comm::fit_cost takes it when noise makes the slope
# negative, as 4 ranks on a loaded machine once did)
assert l["source"] == "measured" and l["alpha_us"] > 0 and 0 <= l["algbw_gbps"] < math.inf, l
assert q["step_ms"] <= q["none_step_ms"], q
assert p["replicate"] == 2 and p["shard_group"] == 2 and len(p["buckets"]) == len(c["buckets"])' "$tmp/o"; then
  ok "measured link: a plan from timed all-reduces ($(choices))"
else bad "measured-link plan (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi
run $mpiexec $fast -n 4 $fsdp $common $auto --replicate 2 --print-plan --steps 1
if [ $rc = 0 ] && c=$(choices) && [ -n "$c" ] && [ -z "$(echo $c | tr -d ' ' | sed 's/none//g')" ]; then
  ok "fast link: auto chooses none for every bucket of the plan ($(echo $c | wc -w) buckets; --print-plan shows both)"
else bad "fast-link plan (exit $rc): ${c:-}" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi
rm -f none.ckpt loop.ckpt loop.jsonl
run $mpiexec -n 4 $fsdp $common --replicate 2 --steps 12 --save none.ckpt
rc1=$rc; run $mpiexec $fast -n 4 $fsdp $common $auto --replicate 2 --steps 12 --save loop.ckpt --metrics loop.jsonl
[ $rc = 0 ] && [ $rc1 = 0 ] && run $si diff none.ckpt loop.ckpt model/ optim/ --rtol 0 --atol 0
if [ $rc = 0 ] && python3 -c 'import json,sys; assert all(json.loads(l)["compress_ranks"]==[0]*4 for l in open(sys.argv[1]))' loop.jsonl; then
  ok "fast link: 12 steps of auto (none throughout) == --compressor none, bit for bit"
else bad "fast-link run differs from none (exit $rc)" "$(cat $tmp/o | tail -5)" "$(cat $tmp/e)" "$(tail -2 loop.jsonl)"; fi

# ---- a slow link: PowerSGD; what fsdp's PowerSGD sends at the chosen rank; Accordion ----
run $mpiexec $slow -n 4 $fsdp $common $auto --replicate 2 --print-plan
if [ $rc = 0 ] && c=$(choices) && [ -z "$(echo $c | tr -d ' ' | sed 's/powersgd//g')" ] &&
   python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["compressor"]; assert p["link"]["source"]=="DTK_AUTO_LINK"; assert p["predicted"]["step_ms"] < p["predicted"]["none_step_ms"]' "$tmp/o"; then
  ok "slow link: auto compresses every bucket"
else bad "slow-link plan (exit $rc): ${c:-}" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi
rm -f s22.ckpt s21.ckpt s22.jsonl s21.jsonl r4.jsonl
run $mpiexec $slow -n 4 $fsdp $common $auto --replicate 2 --steps 14 --save s22.ckpt --metrics s22.jsonl
[ $rc = 0 ] || bad "slow link on 2 x 2 (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 4 $fsdp $common --compressor powersgd --rank 4 --start-iter 3 --replicate 2 --steps 7 --metrics r4.jsonl
[ $rc = 0 ] || bad "powersgd --rank 4 (exit $rc)" "$(cat $tmp/e)"
# Steps 4-7 run at the high rank everywhere (the first interval is critical), then each bucket by
# its regime. Auto's sub-compressors are fsdp's PowerSGD over each bucket's rows, with their own Q
# streams (a seed per bucket), so the weights are not fsdp's --rank 4's bit for bit: the replica
# hop's bytes are (the same matrices at the same rank on the same shard shapes), and the loss
# stays within 2% of it (measured: 0.76% at step 7, from other Q starts). That the sharded
# compression is PowerSGD's over whole matrices is the next check's: 2 x 1 == 2 x 2.
if python3 - s22.jsonl r4.jsonl <<'PY'; then ok "slow link: ranks 0 -> 4 -> 1; at rank 4 the bytes of fsdp's --rank 4, the loss within 2%"
import json, sys
a, p = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
ranks = [r["compress_ranks"] for r in a]
assert all(set(x) == {0} for x in ranks[:3]) and all(set(x) == {4} for x in ranks[3:7]), ranks
assert all(set(x) <= {1, 4} for x in ranks[7:]) and any(1 in x for x in ranks[7:]), ranks
for x, y in zip(a[:7], p):
    assert x["all_reduce_bytes"] == y["all_reduce_bytes"], (x["step"], x["all_reduce_bytes"], y["all_reduce_bytes"])
    assert abs(x["loss"] / y["loss"] - 1) < 0.02, (x["step"], x["loss"], y["loss"])
assert min(r["all_reduce_bytes"] for r in a[7:]) < a[6]["all_reduce_bytes"] < a[0]["all_reduce_bytes"]
PY
else bad "slow link: the run" "$(strip s22.jsonl | tail -8)"; fi

# ---- the shard count: 2 x 1 (whole tensors) == 2 x 2, plan and run ----
# Measured: losses within 5e-8, weights and optimizer state within rtol 1e-5 at atol 1e-6.
run $mpiexec $slow -n 2 $fsdp $common $auto --replicate 2 --steps 14 --save s21.ckpt --metrics s21.jsonl
# Accordion's state too: the whole tensors' norms, whatever the shard count.
[ $rc = 0 ] && run $si diff s21.ckpt s22.ckpt model/ optim/ compress/auto/accordion compress/auto/choice --rtol 1e-5 --atol 1e-6
if [ $rc = 0 ] && python3 - s21.jsonl s22.jsonl <<'PY'; then ok "2 x 1 and 2 x 2: the same choices every step, the same run and Accordion state (f32 rounding)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
assert len(a) == len(b) == 14
for x, y in zip(a, b):
    assert x["compress_ranks"] == y["compress_ranks"], (x["step"], x["compress_ranks"], y["compress_ranks"])
    assert abs(x["loss"] / y["loss"] - 1) < 1e-6, (x["step"], x["loss"], y["loss"])
PY
else bad "2 x 1 vs 2 x 2 (exit $rc)" "$(cat $tmp/o | tail -5)" "$(diff <(strip s21.jsonl) <(strip s22.jsonl))"; fi

# ---- resume: bit for bit on the same R x S; on another, the run goes on ----
# Stopped at step 9, inside an interval (decisions at 3, 7, 11): Accordion's sums are half made,
# and each replica's its own. A save makes them their maximum over every rank in place (one copy
# is saved) and the error buffers their mean over the replicas, so the uninterrupted run saves at
# step 9 too. The last save (13) holds the mean that the decision at 11 took as the maximum over
# the replicas (without that maximum at the save, it differed: seeds 0, 1, 2).
f="$fsdp $common $auto --steps 13"
rm -rf cka cks a.ckpt b.ckpt a.jsonl b.jsonl
run $mpiexec $slow -n 4 $f --replicate 2 --checkpoint-dir cka --checkpoint-every 9 --save a.ckpt --metrics a.jsonl
[ $rc = 0 ] || bad "resume: uninterrupted run (exit $rc)" "$(cat $tmp/e)"
run $mpiexec $slow -n 4 $f --replicate 2 --stop-at 9 --checkpoint-dir cks --metrics b.jsonl
if [ $rc = 0 ] && [ -f cks/step-00000009/index.h5 ]; then
  run $mpiexec $slow -n 4 $f --replicate 2 --resume cks --save b.ckpt --metrics b.jsonl
  # everything but auto/costs and auto/overhead (measured times, as they came out of each run)
  [ $rc = 0 ] && run $si diff a.ckpt b.ckpt model/ optim/ compress/error/ compress/q/ compress/step compress/auto/choice \
    compress/auto/accordion --rtol 0 --atol 0
  if [ $rc = 0 ] && cmp -s <(strip a.jsonl) <(strip b.jsonl); then
    ok "auto on 2 x 2: resume is exact (weights, optimizer, choices, Accordion, error and Q, metrics)"
  else bad "auto: resume differs (exit $rc)" "$(cat $tmp/o | tail -5)" "$(cat $tmp/e)" "$(diff <(strip a.jsonl) <(strip b.jsonl))"; fi
  run $si ls cks/step-00000009
  grep -q "^compress/error/layers.0.feed_forward.w1.weight .*2 shards" $tmp/o && grep -q "^compress/auto/accordion .*rank 0" $tmp/o &&
    ok "the checkpoint: error buffers sharded by rows, Accordion's state one copy" || bad "auto state in the checkpoint" "$(cat $tmp/o)"
  # Another shard count (the same R): the same run up to f32 rounding, the same choices. Another R:
  # no warning, and the saved choices go on until the next decision (Accordion then sees R'
  # replicas' gradients: its choices may differ from the uninterrupted run's).
  for c in "2|2" "8|2" "4|4"; do
    n=${c%%|*} r=${c#*|}
    rm -rf o.ckpt o.jsonl; run $mpiexec $slow -n $n $f --replicate $r --resume cks --save o.ckpt --metrics o.jsonl
    if [ $rc != 0 ] || [ -s $tmp/e ]; then bad "resume on $n ranks --replicate $r (exit $rc)" "$(cat $tmp/e)"; continue; fi
    if [ $r = 2 ]; then
      run $si diff a.ckpt o.ckpt model/ optim/ $same_run
      [ $rc = 0 ] && python3 - a.jsonl o.jsonl <<'PY' && ok "2 x 2's auto state resumed on $n ranks --replicate $r: the same choices, the same run, no warning" || bad "resume on $n ranks --replicate $r" "$(cat $tmp/o | tail -5)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
a = a[9:]
assert [x["step"] for x in a] == [x["step"] for x in b], b
for x, y in zip(a, b):
    assert x["compress_ranks"] == y["compress_ranks"] and abs(x["loss"] / y["loss"] - 1) < 1e-6, (x, y)
PY
    else
      python3 -c 'import json,sys; a=[json.loads(l) for l in open(sys.argv[1])]; b=[json.loads(l) for l in open(sys.argv[2])]; assert b[0]["step"]==10 and b[0]["compress_ranks"]==a[9]["compress_ranks"]==b[1]["compress_ranks"], (a[9], b[0])' a.jsonl o.jsonl &&
        ok "2 x 2's auto state resumed on $n ranks --replicate $r: no warning, the saved choices go on" || bad "resume on $n ranks --replicate $r" "$(head -2 o.jsonl)"
    fi
  done
else bad "stop at 9 (exit $rc)" "$(cat $tmp/e)"; fi

# ---- options that do not fit: exit 2 on every rank ----
expect2 "auto with --rank" "auto chooses the rank itself" $mpiexec -n 4 $fsdp $common --replicate 2 --compressor auto --rank 2 --steps 2
expect2 "auto with --replicate 1" "--compressor auto .*--replicate > 1" $mpiexec -n 2 $fsdp $common --compressor auto --steps 2
expect2 "auto with --buckets auto" "--buckets auto plans again" $mpiexec -n 4 $fsdp $common --replicate 2 --compressor auto --buckets auto --steps 2
expect2 "--auto-ranks HIGH,LOW" "auto_ranks must be two ranks" $mpiexec -n 4 $fsdp $common --replicate 2 --compressor auto --auto-ranks 4,1 --steps 2
expect2 "a bad DTK_AUTO_LINK" "DTK_AUTO_LINK='fast'" $mpiexec -x DTK_AUTO_LINK=fast -n 4 $fsdp $common --replicate 2 $auto --steps 5
finish
