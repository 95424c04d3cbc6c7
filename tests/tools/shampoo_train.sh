#!/usr/bin/env bash
# shampoo-train end to end: learning, world-size invariance (1, 2, 4 ranks; trainer groups),
# exact resume, resume on another world size (blocks reassigned), the preconditioner family
# (eigenvalue-corrected, spectral, pseudo-inverse roots, factor updates every K steps) likewise,
# --print-plan (also psgd-train's and fsdp-train's with Shampoo), bad input.
#   shampoo_train.sh MPIEXEC SHAMPOO_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 st=$2 si=$3
common="$small --global-batch 8 --lr 3e-3 --warmup 2 --eval-every 0 --log-level warn --precondition-frequency 3 --max-preconditioner-dim 48 --shampoo-epsilon 1e-6"

# ---- learning ----
run $st $common --steps 60 --metrics learn.jsonl
if [ $rc = 0 ] && python3 - learn.jsonl <<'PY'; then ok "shampoo learns"; else bad "learning (exit $rc)" "$(cat $tmp/e)" "$(tail -2 learn.jsonl)"; fi
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
assert rows[-1]["loss"] < 3.2 and rows[-1]["optim_state_bytes"] > 0
PY

# ---- world-size invariance: 1, 2, 4 ranks, and 2 groups of 2 ----
# Gradients summed in another order differ in the last bits, and inverse roots of nearly
# singular factors amplify that: with epsilon 1e-12 (the default) 7 steps of this tiny model
# drift by up to 3e-2; with 1e-6 by 1e-5. The optimizer alone, fed identical gradients, is
# bit-identical on any world size (tests/mpi/test_shampoo_mpi.cpp).
for n in 1 2 4; do
  run $mpiexec -n $n $st $common --steps 7 --save ws$n.h5
  [ $rc = 0 ] || bad "$n ranks (exit $rc)" "$(cat $tmp/e)"
done
run $mpiexec -n 4 $st $common --steps 7 --trainers-per-group 2 --save wsg.h5
[ $rc = 0 ] || bad "groups (exit $rc)" "$(cat $tmp/e)"
for f in ws2 ws4 wsg; do
  run $si diff ws1.h5 $f.h5 model/ --rtol 1e-3 --atol 1e-4
  [ $rc = 0 ] && ok "$f == 1 rank" || bad "$f differs" "$(cat $tmp/o)" "$(cat $tmp/e)"
done
run $mpiexec -n 4 $st $common --steps 7 --direction-dtype bf16 --save wsb.h5
run $si diff ws1.h5 wsb.h5 model/ --rtol 0.05 --atol 2e-3
[ $rc = 0 ] && ok "bf16 directions stay close" || bad "bf16 directions" "$(cat $tmp/o)"

# ---- resume: exact, and on another world size ----
run $mpiexec -n 2 $st $common --steps 7 --stop-at 4 --checkpoint-dir ck
[ $rc = 0 ] || bad "first half (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 2 $st $common --steps 7 --resume ck --save r2.h5
run $si diff ws2.h5 r2.h5
[ $rc = 0 ] && ok "resume on 2 ranks is exact" || bad "resume differs" "$(cat $tmp/o)"
run $si ls r2.h5
packed=$(grep -cE '/(factor|root)[0-9]+ +f32 +\[[0-9]+\] ' $tmp/o) whole=$(grep -cE '/(factor|root)[0-9]+ +f32 +\[[0-9]+, ' $tmp/o)
[ $rc = 0 ] && [ "$packed" -gt 0 ] && [ "$whole" = 0 ] && ok "factors and roots stored packed ($packed)" \
  || bad "factors and roots not packed ($packed packed, $whole whole)" "$(grep -E 'factor|root' $tmp/o | head -4)"
run $mpiexec -n 4 $st $common --steps 7 --resume ck --save r4.h5
run $si diff ws1.h5 r4.h5 model/ --rtol 1e-3 --atol 1e-4
[ $rc = 0 ] && ok "2-rank checkpoint resumes on 4 ranks (blocks reassigned)" || bad "resume on 4" "$(cat $tmp/o)" "$(cat $tmp/e)"
run $st $common --steps 7 --resume ck --optimizer adamw --save x.h5
[ $rc = 2 ] && grep -q "\-\-optimizer adamw differs from the checkpoint's shampoo" $tmp/e && [ ! -e x.h5 ] \
  && ok "resume with another optimizer is refused before any work" || bad "optimizer switch (exit $rc)" "$(cat $tmp/e)"

# ---- qr roots and spread root steps: exact resume across a root step, eigenbases saved ----
qr="--root-method qr --root-spread 3 --precondition-frequency 3"
run $mpiexec -n 2 $st $common $qr --steps 8 --save q.h5
[ $rc = 0 ] || bad "qr, spread 3 (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 2 $st $common $qr --steps 8 --stop-at 5 --checkpoint-dir qk
run $mpiexec -n 2 $st $common $qr --steps 8 --resume qk --save qr.h5
run $si diff q.h5 qr.h5
[ $rc = 0 ] && ok "qr roots, spread 3: resume is exact" || bad "qr resume differs (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"
run $si ls q.h5
[ $rc = 0 ] && grep -q "eigvecs0" $tmp/o && ok "qr: eigenbases in the checkpoint" || bad "no eigvecs in the checkpoint" "$(head -20 $tmp/o)"

# ---- the preconditioner family: 1, 2 and 4 ranks alike, resume on 4 ranks the 2 ranks' run,
# its state in the checkpoint ----
# (eigenvalue-corrected's epsilon 1e-8: Adam's; its bases are arbitrary within the degenerate
# eigenspaces of rank-deficient factors, the embeddings' and norms', where rounding then
# decides: those go diagonal. With one QR iteration per root step (soap) the bases are not
# converged, and the order of their columns by estimated eigenvalue, which the positional second
# moment follows, is decided by rounding for close eigenvalues: 7 steps at lr 3e-3 end up to
# 1e-3 apart across world sizes, hence its tolerance; the optimizer itself, fed the same
# gradients, is bit-identical on 1, 2 and 4 ranks (tests/mpi/test_shampoo_mpi.cpp). The
# spectral runs have no root steps.)
for c in "ec|--preconditioner eigenvalue-corrected --grafting none --ec-epsilon 1e-8 --diagonal-params norm,embeddings|corrected_second_moment eigvecs1" \
         "soap|--preconditioner eigenvalue-corrected --root-method qr --root-spread 3 --ec-epsilon 1e-8 --diagonal-params norm,embeddings|corrected_second_moment eigvecs0|--rtol 1e-2 --atol 3e-3" \
         "muon|--preconditioner spectral --grafting none --lr 2e-2 --diagonal-params embeddings,output --precondition-frequency 1 --direction-dtype bf16|filtered_grad" \
         "svd|--preconditioner spectral --spectral-method exact --spectral-scale rms --precondition-frequency 1 --weight-decay 1e-2 --momentum 0.9 --nesterov|momentum" \
         "pinv|--root-method pseudo-inverse --shampoo-epsilon 0 --rank-rtol 1e-6|root0" \
         "every3|--factor-update-every 3|root0"; do
  IFS='|' read -r name opts keys tol <<<"$c"
  tol=${tol:---rtol 1e-3 --atol 1e-4}
  # (--precondition-frequency 1 given again after $common's 3: the last one counts)
  for n in 1 2 4; do run $mpiexec -n $n $st $common $opts --steps 7 --save p$name$n.h5; done
  [ $rc = 0 ] || bad "$name on 4 ranks (exit $rc)" "$(cat $tmp/e)"
  run $si diff p${name}1.h5 p${name}2.h5 model/ $tol; r2=$rc
  run $si diff p${name}1.h5 p${name}4.h5 model/ $tol
  [ $r2 = 0 ] && [ $rc = 0 ] && ok "$name: 1, 2 and 4 ranks alike" || bad "$name differs across world sizes" "$(cat $tmp/o)"
  rm -rf pk; run $mpiexec -n 2 $st $common $opts --steps 7 --stop-at 4 --checkpoint-dir pk
  run $mpiexec -n 4 $st $common $opts --steps 7 --resume pk --save pr$name.h5
  [ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff p${name}2.h5 pr$name.h5 model/ $tol
  [ $rc = 0 ] && ok "$name: 2 ranks' checkpoint resumes on 4 ranks, no warning" || bad "$name resume on 4" "$(cat $tmp/o)" "$(cat $tmp/e)"
  run $si ls p${name}2.h5
  for k in $keys; do grep -q "/$k " $tmp/o || bad "$name: no $k in the checkpoint" "$(grep shampoo $tmp/o | head -8)"; done
done
run $si ls pmuon2.h5
grep -q "tok_embeddings.weight/block0/filtered_grad" $tmp/o && ! grep -q "/factor0 \|/root0 \|/graft " $tmp/o &&
  ok "muon: no factors, no grafting state: the filtered gradients" || bad "muon state" "$(grep shampoo $tmp/o | head)"
run $mpiexec -n 2 $st $common --preconditioner spectral --grafting none --lr 2e-2 --precondition-frequency 1 --steps 60 --metrics muon.jsonl
[ $rc = 0 ] && python3 - muon.jsonl <<'PY' && ok "spectral (muon) learns" || bad "muon learning (exit $rc)" "$(cat $tmp/e)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
assert rows[-1]["loss"] < 3.2
PY

# ---- eigenvalue-corrected in f64: 1, 2 and 4 ranks, and a 4 -> 2 rank resume, 30 steps ----
# With f64 factors and bases and converged (eigh) bases SOAP agrees across world sizes about as
# well as the roots do (measured: 8e-6, 1.2e-5 for 4 ranks, the resume 3.5e-6; in f32 4e-4).
# The norms, embeddings and output go diagonal: their factors are rank-deficient, and a basis
# within a degenerate eigenspace is rounding's choice.
f64="--preconditioner eigenvalue-corrected --grafting none --ec-epsilon 1e-6 --factor-dtype f64 --basis-dtype f64 --diagonal-params norm,embeddings,output"
for n in 1 2 4; do run $mpiexec -n $n $st $common $f64 --steps 30 --save s64-$n.h5; done
rm -rf sk; run $mpiexec -n 4 $st $common $f64 --steps 30 --stop-at 15 --checkpoint-dir sk
run $mpiexec -n 2 $st $common $f64 --steps 30 --resume sk --save s64-r.h5
far=""
for f in s64-2 s64-4 s64-r; do run $si diff s64-1.h5 $f.h5 model/ --rtol 0 --atol 3e-5; [ $rc = 0 ] || far="$far $f"; done
run $si ls s64-2.h5
[ -z "$far" ] && grep -qE "corrected_second_moment +f64" $tmp/o && grep -qE "eigvecs0 +f64" $tmp/o \
  && ok "eigenvalue-corrected with f64 bases: 1, 2, 4 ranks and a 4 -> 2 resume within 3e-5, bases stored f64" \
  || bad "eigenvalue-corrected in f64 across world sizes (beyond 3e-5:${far:- none})" "$(head -20 $tmp/o)"

# ---- Dion: rank-r factors instead of the matrices' gradients ----
# Each rank keeps its own buffer; only P and R (summed, then / W) cross the network, so 1, 2 and
# 4 ranks differ by the order of the sums alone (measured 8e-8 on 2 ranks). Its state is each
# rank's buffer (dion/<p>/momentum, per rank) and Q (replicated); a resume on another world size
# takes the buffers' mean, which continues the run exactly up to rounding.
dion="--preconditioner dion --diagonal-params embeddings,output --lr 1e-2 --precondition-frequency 100"
for n in 1 2 4; do run $mpiexec -n $n $st $common $dion --steps 7 --save dion$n.h5 --metrics dion$n.jsonl; done
[ $rc = 0 ] || bad "dion on 4 ranks (exit $rc)" "$(cat $tmp/e)"
run $si diff dion1.h5 dion2.h5 model/ --rtol 0 --atol 1e-6; r2=$rc
run $si diff dion1.h5 dion4.h5 model/ --rtol 0 --atol 1e-6
[ $r2 = 0 ] && [ $rc = 0 ] && ok "dion: 1, 2 and 4 ranks within 1e-6" || bad "dion differs across world sizes" "$(cat $tmp/o)"
rm -rf dk; run $mpiexec -n 2 $st $common $dion --steps 7 --stop-at 4 --checkpoint-dir dk
run $mpiexec -n 2 $st $common $dion --steps 7 --resume dk --save dion2r.h5
run $si diff dion2.h5 dion2r.h5
[ $rc = 0 ] && ok "dion: resume on 2 ranks is exact (each rank's own buffer)" || bad "dion resume" "$(cat $tmp/o)"
run $mpiexec -n 4 $st $common $dion --steps 7 --resume dk --save dion4r.h5
[ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff dion2.h5 dion4r.h5 model/ --rtol 0 --atol 1e-6
[ $rc = 0 ] && ok "dion: 2 ranks' checkpoint resumes on 4 ranks (the buffers' mean), no warning" || bad "dion resume on 4" "$(cat $tmp/o)" "$(cat $tmp/e)"
run $si ls dk/step-00000004.h5
grep -q "^ranks/1/optim/dion/layers.0.attention.wq.weight/momentum " $tmp/o && grep -q "^optim/dion/layers.0.feed_forward.w2.weight/q " $tmp/o &&
  ! grep -q "optim/shampoo/layers.0.attention.wq.weight/" $tmp/o && ok "dion: a buffer per rank and Q in the checkpoint, no blocks" ||
  bad "dion state" "$(grep dion $tmp/o | head -6)"
# The bytes: P and R, (m + n) r per matrix, instead of the matrices' gradients.
run $mpiexec -n 2 $st $common $dion --dion-sync gradients --steps 7 --save diong.h5 --metrics diong.jsonl
[ $rc = 0 ] && run $si diff dion1.h5 diong.h5 model/ --rtol 1e-3 --atol 1e-4
[ $rc = 0 ] && python3 - dion2.jsonl diong.jsonl <<'PY' && ok "dion: factors send less than gradients, same model" || bad "dion bytes (exit $rc)" "$(cat $tmp/o)"
import json, sys
f, g = ([json.loads(l) for l in open(p)][-1] for p in sys.argv[1:])
sent = lambda r: r["comm_bytes"] + r["optim_comm_bytes"]
print(f"factors {sent(f)} B/step, gradients {sent(g)} B/step")
assert sent(f) < 0.6 * sent(g), (sent(f), sent(g))
PY
run $mpiexec -n 2 $st $common $dion --steps 60 --metrics dionl.jsonl
[ $rc = 0 ] && python3 - dionl.jsonl <<'PY' && ok "dion learns" || bad "dion learning (exit $rc)" "$(cat $tmp/e)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
assert rows[-1]["loss"] < 3.2
PY
run $mpiexec -n 2 $st $common $dion --dion-rank 3 --steps 5 --print-plan
[ $rc = 0 ] && jq -e '.dion.matrices | (length > 0) and all(.rank == 3)' $tmp/o >/dev/null &&
  jq -e '.dion.matrices[] | select(.param == "layers.0.feed_forward.w2.weight") | .transposed' $tmp/o >/dev/null &&
  ok "dion: --print-plan lists its matrices, their rank and orientation" || bad "dion plan (exit $rc)" "$(head -c 400 $tmp/o)"
expect2 "--momentum with dion" "\-\-momentum does not fit \-\-preconditioner dion" $mpiexec -n 2 $st $common $dion --steps 2 --momentum 0.9
expect2 "a dion rank fraction of 0" "dion_rank_fraction must be in (0, 1]" $st $common $dion --steps 2 --dion-rank-fraction 0
expect2 "--dion-rank with spectral" "\-\-dion-rank does not fit \-\-preconditioner spectral" \
  $st $common --preconditioner spectral --precondition-frequency 1 --steps 2 --dion-rank 4
expect2 "--dion-sync on resume" "dion-sync" $st $common $dion --steps 7 --resume dk --dion-sync gradients

# ---- adamw and sgd in the same loop ----
run $st $common --steps 3 --optimizer adamw
[ $rc = 0 ] && ok "--optimizer adamw" || bad "adamw (exit $rc)" "$(cat $tmp/e)"

# ---- --print-plan: the blocks and their owners, before the first step ----
# Every parameter element is in one block, each rank of the group computes its blocks' elements,
# and the owners are the ranks of a group (2 groups of 2: owners 0 and 1).
run $mpiexec -n 4 $st $common --steps 5 --trainers-per-group 2 --print-plan --checkpoint-dir plan-ck
if [ $rc = 0 ] && [ ! -e plan-ck ] && python3 -c '
import json, math, sys
p = json.load(open(sys.argv[1]))
blocks = sum(math.prod(b["shape"]) if b["shape"] else 1 for b in p["blocks"])
assert p["group_size"] == 2 and sum(p["elements_per_rank"]) == blocks, (p["group_size"], p["elements_per_rank"], blocks)
assert {b["owner"] for b in p["blocks"]} == {0, 1} and p["preconditioner"] == "root"
' "$tmp/o" 2>"$tmp/py"; then
  ok "--print-plan: every block once, its owner in the group, each rank's elements; nothing trained or written"
else bad "--print-plan (exit $rc)" "$(cat "$tmp/e" "$tmp/py")" "$(head -c 400 "$tmp/o")"; fi
# psgd-train and fsdp-train with Shampoo: its plan too, beside theirs; a run without a plan: exit 2
tools=$(dirname "$(dirname "$st")") plain="$small --global-batch 8 --log-level warn"
psgd=$tools/psgd-train/psgd-train fsdp=$tools/fsdp-train/fsdp-train
run $psgd $plain --compressor powersgd --optimizer shampoo --steps 2 --print-plan
[ $rc = 0 ] && jq -e '.blocks | length > 0' "$tmp/o" >/dev/null && ok "psgd-train --optimizer shampoo --print-plan: Shampoo's blocks" \
  || bad "psgd-train --optimizer shampoo --print-plan (exit $rc)" "$(cat "$tmp/e")"
run $mpiexec -n 2 $fsdp $plain --optimizer shampoo --steps 2 --print-plan
[ $rc = 0 ] && jq -e '(.fsdp.buckets | length > 0) and (.shampoo.blocks | length > 0)' "$tmp/o" >/dev/null \
  && ok "fsdp-train --optimizer shampoo --print-plan: the bucket plan under fsdp, the blocks under shampoo" \
  || bad "fsdp-train --optimizer shampoo --print-plan (exit $rc)" "$(cat "$tmp/e")" "$(head -c 300 "$tmp/o")"
expect2 "--print-plan of a run without a plan" "print-plan" $psgd $plain --optimizer adamw --steps 2 --print-plan
# ... and where only the trainer finds it (no component has a plan): one line from rank 0, no MPI_ABORT
run $mpiexec -n 2 $st $plain --optimizer adamw --steps 2 --print-plan
[ $rc = 2 ] && [ "$(grep -c "no part of this run makes a plan" "$tmp/e")" = 1 ] && ! grep -q MPI_ABORT "$tmp/e" \
  && ok "shampoo-train --optimizer adamw --print-plan: exit 2, one line" \
  || bad "shampoo-train --optimizer adamw --print-plan (exit $rc)" "$(cat "$tmp/e")"

# ---- bad input ----
expect2 "groups do not divide the world" "trainers-per-group" $mpiexec -n 4 $st $common --steps 2 --trainers-per-group 3
expect2 "unknown optimizer" "optimizer" $st $common --steps 2 --optimizer lion
expect2 "unknown root method" "root-method" $st $common --steps 2 --root-method cholesky
expect2 "a root spread above the frequency" "root_spread" $st $common --steps 2 --root-spread 4
expect2 "a qr tolerance above 1" "qr-tolerance" $st $common --steps 2 --root-method qr --qr-tolerance 2
expect2 "a start step before the frequency (the reference refuses it)" "start_preconditioning_step" $mpiexec -n 2 $st $common --steps 2 --precondition-frequency 4 --start-preconditioning-step 2
# options that do not fit the preconditioner: one line naming both, exit 2 on every rank
expect2 "a root method with spectral" "\-\-root-method qr does not fit \-\-preconditioner spectral" \
  $mpiexec -n 2 $st $common --steps 2 --preconditioner spectral --root-method qr --precondition-frequency 1
expect2 "a frequency with spectral" "\-\-precondition-frequency does not fit \-\-preconditioner spectral" \
  $mpiexec -n 2 $st $common --steps 2 --preconditioner spectral
expect2 "--exponent-override with eigenvalue-corrected" "\-\-exponent-override does not fit \-\-preconditioner eigenvalue-corrected" \
  $mpiexec -n 2 $st $common --steps 2 --preconditioner eigenvalue-corrected --exponent-override 2
expect2 "newton with eigenvalue-corrected" "\-\-root-method newton does not fit" \
  $st $common --steps 2 --preconditioner eigenvalue-corrected --root-method newton
expect2 "a Newton-Schulz count with root" "\-\-newton-schulz-steps does not fit \-\-preconditioner root" \
  $st $common --steps 2 --newton-schulz-steps 3
expect2 "--ec-beta2 with spectral" "\-\-ec-beta2 does not fit" $st $common --steps 2 --preconditioner spectral \
  --precondition-frequency 1 --ec-beta2 0.9
expect2 "a rank tolerance without the pseudo-inverse" "need \-\-root-method pseudo-inverse" $st $common --steps 2 --rank-rtol 1e-3
expect2 "epsilon with the pseudo-inverse" "\-\-shampoo-epsilon 0.001 does not fit \-\-root-method pseudo-inverse" \
  $st $common --steps 2 --root-method pseudo-inverse --shampoo-epsilon 1e-3
expect2 "epsilon 0 without the pseudo-inverse" "\-\-shampoo-epsilon 0 needs" $st $common --steps 2 --shampoo-epsilon 0
expect2 "an unknown preconditioner" "preconditioner" $st $common --steps 2 --preconditioner kfac
run $st --help
[ $rc = 0 ] && grep -q -- "--precondition-frequency" "$tmp/o" && ok "--help" || bad "--help"

finish
