#!/usr/bin/env bash
# psgd-train --sync diloco|streaming end to end: with H = 1, outer lr 1, no outer momentum and
# SGD inner steps it is every-step training (the algebra); a resume continues bit for bit on the
# same world size (a fragment in flight at the checkpoint, int8 error feedback, PowerSGD on the
# pseudo-gradients) and on another as documented; the checkpoint and the metrics carry the
# outer state; options that do not fit exit 2 on every rank.
#   psgd_diloco.sh MPIEXEC PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 si=$3
common="$small --data synthetic --global-batch 8 --warmup 0 --eval-every 0 --log-level warn"

# ---- H = 1, eta = 1, mu = 0, SGD (momentum 0.9, which is linear): every-step data parallelism.
# --clip 0: clipping acts on each replica's own gradient under --sync diloco. Measured on 4 ranks
# over 6 steps: at most 3.9e-7 relative, 2.4e-7 absolute ----
sgd="$common --optimizer sgd --lr 0.1 --clip 0 --steps 6 --compressor none"
h1="--sync diloco --sync-every 1 --outer-lr 1 --outer-momentum 0"
run $mpiexec -n 4 $psgd $sgd --save every.h5
[ $rc = 0 ] || bad "every-step run (exit $rc)" "$(cat $tmp/e)"
for g in 1 2; do
  run $mpiexec -n 4 $psgd $sgd $h1 --sync-groups $g --save h1g$g.h5
  [ $rc = 0 ] || bad "H = 1 run, groups of $g (exit $rc)" "$(cat $tmp/e)"
  run $si diff h1g$g.h5 every.h5 model/ --rtol 1e-6 --atol 1e-7
  if [ $rc = 0 ]; then ok "H = 1, outer lr 1, momentum 0 equals every-step SGD within 1e-6 (4 ranks, groups of $g)"
  else bad "H = 1 differs from every-step (groups of $g)" "$(tail -5 $tmp/o)"; fi
done
# and the check can fail: a real DiLoCo (H = 2) is not every-step training
run $mpiexec -n 4 $psgd $sgd --sync diloco --sync-every 2 --outer-lr 1 --outer-momentum 0 --save h2.h5
run $si diff h2.h5 every.h5 model/ --rtol 1e-6 --atol 1e-7 -q
if [ $rc = 1 ]; then ok "H = 2 differs from every-step training"; else bad "H = 2 matched every-step training (diff exit $rc)"; fi

# ---- resume: 10 steps == 7 + resume + 3, bit for bit. Streaming, 2 fragments of H = 4, tau = 1:
# fragment 1 is sent after step 7 and applied after step 8, so the checkpoint holds its mean ----
strip() { python3 -c 'import json,sys; [print(json.dumps({k: r.get(k) for k in ("step","loss","grad_norm","comm_bytes","outer_bytes","outer_grad_norm")})) for r in map(json.loads, open(sys.argv[1]))]' "$1"; }
resume_check() {  # resume_check NAME OPTIONS...
  local name=$1; shift
  rm -rf ck a.jsonl b.jsonl
  run $mpiexec ${rx:-} -n 2 $psgd $common --steps 10 "$@" --save full.h5 --metrics a.jsonl
  [ $rc = 0 ] || { bad "$name: uninterrupted run (exit $rc)" "$(cat $tmp/e)"; return; }
  run $mpiexec ${rx:-} -n 2 $psgd $common --steps 10 "$@" --stop-at 7 --checkpoint-dir ck --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: first part (exit $rc)" "$(cat $tmp/e)"; return; }
  run $mpiexec ${rx:-} -n 2 $psgd $common --steps 10 "$@" --resume ck --save resumed.h5 --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: resumed part (exit $rc)" "$(cat $tmp/e)"; return; }
  run $si diff full.h5 resumed.h5 --rtol 0 --atol 0
  if [ $rc = 0 ] && cmp -s <(strip a.jsonl) <(strip b.jsonl); then ok "$name: resume is exact (every tensor, the losses and bytes)"
  else bad "$name: resume differs (diff exit $rc)" "$(tail -5 $tmp/o)" "$(diff <(strip a.jsonl) <(strip b.jsonl))"; fi
}
resume_check "streaming int8" --lr 1e-2 --compressor none --sync streaming --fragments 2 --sync-every 4 --sync-delay 1 --outer-dtype int8
rx="-x DTK_AUTO_LINK=1,100" resume_check "--sync-every auto (H chosen at step 5, kept by the checkpoint)" --lr 1e-2 --compressor none --sync diloco --sync-every auto
# F chosen with H (2 here, the state moved from the 16 fragments it was laid out in until then),
# its int8 error feedback moving with it; fragment 1 in flight at the checkpoint
rx="-x DTK_AUTO_LINK=1,100" resume_check "streaming, F chosen with H (kept by the checkpoint)" --lr 1e-2 --compressor none --sync streaming --sync-every auto --outer-dtype int8
resume_check "diloco + powersgd" --lr 1e-2 --sync diloco --sync-every 3 --compressor powersgd --rank 2
run $si ls full.h5
if [ $rc = 0 ] && grep -q "^diloco/momentum/output.weight" $tmp/o && grep -q "ranks/1/diloco/local/output.weight" $tmp/o \
   && grep -q "ranks/0/diloco/compress/0/error/output.weight" $tmp/o && grep -q "^diloco/compress/0/q/output.weight" $tmp/o; then
  ok "shard-inspect ls shows the outer state (momentum, per-rank local weights, PowerSGD's error and Q)"
else bad "the checkpoint lacks the outer state" "$(grep diloco $tmp/o | head)"; fi
python3 - a.jsonl <<'PY' && ok "metrics: outer bytes after steps 3, 6, 9, outer_grad_norm with them, comm_bytes counting them" || bad "metrics of the outer steps" "$(head -4 a.jsonl)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    sync = r["step"] % 3 == 0
    assert (r["outer_bytes"] > 0) == sync and ("outer_grad_norm" in r) == sync, r
    assert r["comm_bytes"] == r["outer_bytes"], r  # groups of one: no inner all-reduce
    assert r["outer_comm_ms"] >= 0
PY

# ---- a run that ends with a fragment in flight (sent after step 5, due after 6): its exchange is
# waited for at the exit (it crashed the exit, the heap corrupted, before the fix) ----
for w in f32 int8; do
  run $mpiexec -n 4 $psgd $common --lr 1e-2 --compressor none --sync streaming --sync-groups 2 --fragments 2 --sync-every 4 --outer-dtype $w --steps 5
  if [ $rc = 0 ]; then ok "a run ending with a fragment in flight ($w) exits 0"; else bad "a run ending with a fragment in flight ($w): exit $rc" "$(tail -5 $tmp/e)"; fi
done

# ---- --sync-every auto: the smallest H whose exchange holds the steps at most 5%, from the link
# (DTK_AUTO_LINK here: CI has no slow link) and the steps timed (5, the first a warm-up) ----
plan() { python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))["sync_every_auto"]
print(p["every"], p["link"]["source"], p["overhead"] <= 0.05, 2 * p["overhead"] > 0.05, p["held_per_step_ms"] == 0)' "$tmp/o"; }
auto="--lr 1e-2 --compressor none --sync diloco --sync-groups 2 --sync-every auto"
run $mpiexec -x DTK_AUTO_LINK=1,100 -n 4 $psgd $common $auto --print-plan
if [ $rc = 0 ] && [ "$(plan | cut -d" " -f1-3)" = "1 DTK_AUTO_LINK True" ]; then ok "auto on a fast link: H = 1"
else bad "auto on a fast link (exit $rc): $(plan 2>&1)" "$(cat $tmp/e)"; fi
# The plan's own figures, whatever the steps' time here: H's overhead within 5%, half of H's not.
run $mpiexec -x DTK_AUTO_LINK=2000,0.01 -n 4 $psgd $common $auto --print-plan
if [ $rc = 0 ] && read -r h src fits half _ <<<"$(plan)" && [ "$h" -gt 1 ] && [ "$src $fits $half" = "DTK_AUTO_LINK True True" ]; then
  ok "auto on a slow link (2 ms + 10 MB/s): H = $h, the smallest power of 2 whose exchange holds the steps at most 5%"
else bad "auto on a slow link (exit $rc): $(plan 2>&1)" "$(cat $tmp/e)"; fi
# Streaming, 2 fragments, tau 10: the exchange (3.3 ms) hides behind 10 steps: the smallest H above tau F.
run $mpiexec -x DTK_AUTO_LINK=1000,0.02 -n 4 $psgd $common --lr 1e-2 --compressor none --sync streaming --fragments 2 --sync-delay 10 --sync-groups 2 --sync-every auto --print-plan
if [ $rc = 0 ] && [ "$(plan | cut -d" " -f1,5)" = "32 True" ]; then
  ok "auto with streaming's overlap (tau 10): H = 32, the exchange hidden"
else bad "auto with streaming (exit $rc): $(plan 2>&1)" "$(cat $tmp/e)"; fi
# F with H (streaming without --fragments): on a fast link F = 2 and H = 4, the smallest with
# tau = 1; on a slow one, the plan's own figures: each F weighed at its smallest fitting H, and
# the chosen the F of the smallest H (ties: the larger F).
fplan() { python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))["sync_every_auto"]
w, f, h = p["weighed"], p["fragments"], p["every"]
for c in w:
    assert c["fits"] == (c["overhead"] <= 0.05), c
    assert c["every"] // c["fragments"] > 1, c                      # tau = 1 below H / F
    half = c["every"] // 2
    assert not c["fits"] or half // c["fragments"] <= 1 or 2 * c["overhead"] > 0.05, c   # the smallest
fit = [c for c in w if c["fits"]]
best = min(fit, key=lambda c: (c["every"], -c["fragments"])) if fit else min(w, key=lambda c: c["overhead"])
assert (best["fragments"], best["every"]) == (f, h), (best, f, h)
print(f, h, len(w))' "$tmp/o"; }
sauto="--lr 1e-2 --compressor none --sync streaming --sync-groups 2 --sync-every auto"
run $mpiexec -x DTK_AUTO_LINK=1,100 -n 4 $psgd $common $sauto --print-plan
if [ $rc = 0 ] && [ "$(fplan)" = "2 4 4" ]; then ok "auto F on a fast link: F = 2, H = 4 (2, 4, 8 and 16 weighed)"
else bad "auto F on a fast link (exit $rc): $(fplan 2>&1)" "$(cat $tmp/e)"; fi
run $mpiexec -x DTK_AUTO_LINK=2000,0.002 -n 4 $psgd $common $sauto --print-plan
if [ $rc = 0 ] && read -r f h _ <<<"$(fplan)"; then ok "auto F on a slow link (2 ms + 2 MB/s): F = $f, H = $h, the smallest H of the F weighed"
else bad "auto F on a slow link (exit $rc): $(fplan 2>&1)" "$(cat $tmp/e)"; fi
rm -f auto.jsonl
run $mpiexec -x DTK_AUTO_LINK=1,100 -n 4 $psgd $common $auto --steps 8 --metrics auto.jsonl
python3 - auto.jsonl <<'PY' && ok "auto: no exchange while the steps are timed, then every step (H = 1)" || bad "auto's exchanges" "$(cat auto.jsonl | head -8)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["outer_bytes"] > 0 for r in rows] == [False] * 4 + [True] * 4, [r["outer_bytes"] for r in rows]
PY

# ---- another world size: the outer state exactly, a new round from the outer weights ----
rm -rf ck4; run $mpiexec -n 4 $psgd $common --lr 1e-2 --steps 8 --compressor none --sync diloco --sync-every 4 --outer-dtype e3m0 --stop-at 6 --checkpoint-dir ck4
[ $rc = 0 ] || bad "4-rank first part (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 2 $psgd $common --lr 1e-2 --steps 8 --compressor none --sync diloco --sync-every 4 --outer-dtype e3m0 --resume ck4 --save r2.h5
if [ $rc = 0 ] && grep -q "every replica starts a new round from the outer weights" $tmp/e \
   && [ "$(grep -c 'new round' $tmp/e)" = 1 ]; then ok "4 -> 2 ranks: resumed, one warning naming the new round"
else bad "4 -> 2 ranks (exit $rc)" "$(cat $tmp/e)"; fi

# ---- options that do not fit: exit 2 on every rank ----
expect2 "--sync-every without --sync" "--sync-every needs --sync diloco or streaming" $mpiexec -n 2 $psgd $common --steps 2 --sync-every 4
expect2 "--fragments with diloco" "fragments need --sync streaming" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --fragments 2
expect2 "H not a multiple of F" "not a multiple of --fragments" $mpiexec -n 2 $psgd $common --steps 2 --sync streaming --sync-every 6 --fragments 4
expect2 "delay too long" "--sync-delay 2 must be below" $mpiexec -n 2 $psgd $common --steps 2 --sync streaming --sync-every 8 --fragments 4 --sync-delay 2
expect2 "more fragments than parameters" "the model has 21 parameters" $mpiexec -n 2 $psgd $common --steps 2 --sync streaming --sync-every 32 --fragments 32 --sync-delay 0
expect2 "groups that do not divide" "--sync-groups 3 does not divide" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --sync-groups 3
expect2 "shampoo inside" "the inner optimizer is --optimizer sgd or adamw" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --optimizer shampoo
expect2 "auto outside" "with --compressor auto" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --compressor auto
expect2 "outer dtype with a compressor" "--outer-dtype int8 is the plain exchange's" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --compressor powersgd --outer-dtype int8
expect2 "auto with a compressor" "--sync-every auto plans the mean's exchange" $mpiexec -n 2 $psgd $common --steps 2 --sync diloco --sync-every auto
expect2 "H not a number" "--sync-every 4x: expected a number of steps" $mpiexec -n 2 $psgd $common --steps 2 --compressor none --sync diloco --sync-every 4x
expect2 "another H on resume" "--sync-every 5 differs from the checkpoint's 3" $mpiexec -n 2 $psgd $common --steps 10 --resume ck --sync-every 5
finish
