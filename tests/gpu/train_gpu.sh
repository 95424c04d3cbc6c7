#!/usr/bin/env bash
# Training on the GPU end to end (ctest -L gpu; scripts/gpu-check runs it too). Skipped without a
# GPU (exit 77, which ctest reports as skipped).
#   - several ranks: with 2 GPUs or more, N = one rank per GPU over NCCL; with one GPU, 2 ranks
#     sharing it over --backend mpi (staging through host memory), and --backend nccl refused
#     there (exit 2, one line: NCCL cannot put two ranks on one GPU). fsdp-train with N shards,
#     HSDP (--replicate 2), shampoo-train and psgd-train across the ranks, each against the same
#     run on one rank (the same global batch: equal up to float summation order);
#   - resume: a run stopped with --stop-at and resumed is the run that never stopped, bit for bit
#     (shard-inspect diff, exact): psgd-train and shampoo-train on one rank, fsdp-train's sharded
#     state on N ranks, and resnet-8 (batch norm's running statistics);
#   - no host wait inside a step: psgd-train's debug line counts the host's stalls on the GPU;
#   - resnet-8 on the GPU: the losses of the CPU's run, and learning (synthetic images, or
#     Fashion-MNIST where it is installed).
#   train_gpu.sh MPIEXEC BIN_DIR        (BIN_DIR/<program>/<program>)
# DTK_GPU_CHECK_DEVICE=cpu runs the same on the CPU as if there were one GPU (the NCCL refusal
# left out): a check of this script where no GPU exists.
set -u
mpiexec=$1 bin=$(realpath "$2")
dev=${DTK_GPU_CHECK_DEVICE:-cuda}
if [ "$dev" = cpu ]; then ngpu=1
else ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
if [ "$ngpu" = 0 ]; then echo "skipped: no GPU"; exit 77; fi  # ctest: SKIP_RETURN_CODE
. "$(dirname "$0")/../common/train_lib.sh"
psgd=$bin/psgd-train/psgd-train shampoo=$bin/shampoo-train/shampoo-train fsdp=$bin/fsdp-train/fsdp-train
si=$bin/shard-inspect/shard-inspect datapack=$bin/data-pack/data-pack
skip() { echo "skip $1"; }

common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn --device $dev"
exact="--param-dtype f32 --reduce-dtype f32"
# N ranks against 1: the same sums in another order. atol 1e-5 is 1e-3 of one AdamW update
# (psgd_train.sh: a weight whose gradient nearly cancels moved 2.3e-6 in Release builds).
close="--rtol 1e-4 --atol 1e-5"
sham="--precondition-frequency 3 --max-preconditioner-dim 48 --shampoo-epsilon 1e-6"

# ---- the ranks: one per GPU over NCCL, or 2 sharing the one GPU over MPI ----
if [ "$ngpu" -ge 2 ]; then n=$ngpu backend=nccl; else n=2 backend=mpi; fi
[ "$dev" = cpu ] && backend=mpi
launch="$mpiexec -n $n"
wire="--backend $backend"

# fsdp-train: N shards (f32 gathers and reductions: the same sums as one rank, reordered).
run $fsdp $common $exact --steps 8 --save ref.h5
[ $rc = 0 ] || bad "fsdp-train on 1 rank (exit $rc)" "$(cat $tmp/e)"
run $launch $fsdp $common $exact $wire --steps 8 --save fs.ckpt --metrics f32.jsonl
[ $rc = 0 ] && run $si diff ref.h5 fs.ckpt model/ optim/ $close
[ $rc = 0 ] && ok "fsdp-train: $n shards over $backend == 1 rank" || bad "fsdp-train on $n ranks over $backend (exit $rc)" "$(cat $tmp/o $tmp/e)"
# HSDP: 2 replicas of N/2 shards (on 2 ranks: 2 replicas of 1).
if [ $((n % 2)) = 0 ]; then
  run $launch $fsdp $common $exact $wire --steps 8 --replicate 2 --save hs.ckpt
  [ $rc = 0 ] && run $si diff ref.h5 hs.ckpt model/ optim/ $close
  [ $rc = 0 ] && ok "fsdp-train: HSDP --replicate 2 on $n ranks over $backend == 1 rank" || bad "HSDP on $n ranks (exit $rc)" "$(cat $tmp/o $tmp/e)"
else skip "HSDP: $n ranks do not split into 2 replicas"; fi
# bf16 gathers (the default): the loss curve within 2% of f32's.
run $launch $fsdp $common $wire --steps 8 --metrics bf16.jsonl
[ $rc = 0 ] && python3 - bf16.jsonl f32.jsonl <<'PY' && ok "fsdp-train: bf16 gathers on $n ranks, losses within 2% of f32" || bad "fsdp-train bf16 on $n ranks (exit $rc)" "$(cat $tmp/e)"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:])
worst = max(abs(x / y - 1) for x, y in zip(a, b))
print(f"bf16 against f32 gathers: worst relative loss difference {worst:.2e}")
assert len(a) == len(b) == 8 and worst < 0.02, (a, b)
PY
# shampoo-train: each rank preconditions its blocks, one all-gather of the directions.
run $shampoo $common $sham --steps 7 --save ws1.h5
[ $rc = 0 ] && run $launch $shampoo $common $sham $wire --steps 7 --save wsn.h5
# (inverse roots amplify the reordered sums: shampoo_train.sh's tolerance)
[ $rc = 0 ] && run $si diff ws1.h5 wsn.h5 model/ --rtol 1e-3 --atol 1e-4
[ $rc = 0 ] && ok "shampoo-train: $n ranks over $backend == 1 rank" || bad "shampoo-train on $n ranks (exit $rc)" "$(cat $tmp/o $tmp/e)"
# Dion: the power iteration on the GPU is the CPU's up to the kernels' rounding; N ranks (their
# factors averaged, each keeping its own buffer) and N shards of fsdp-train are the one rank's.
dion="--optimizer shampoo --preconditioner dion --diagonal-params embeddings,output"
run $shampoo $common $dion --steps 7 --save d1.h5
[ $rc = 0 ] && run $shampoo ${common/--device $dev/--device cpu} $dion --steps 7 --save dcpu.h5
[ $rc = 0 ] && run $si diff dcpu.h5 d1.h5 model/ --rtol 1e-3 --atol 1e-5
[ $rc = 0 ] && ok "dion: $dev == cpu" || bad "dion on $dev against the CPU (exit $rc)" "$(cat $tmp/o $tmp/e)"
run $launch $shampoo $common $dion $wire --steps 7 --save dn.h5
[ $rc = 0 ] && run $si diff d1.h5 dn.h5 model/ --rtol 1e-3 --atol 1e-5
[ $rc = 0 ] && ok "dion: shampoo-train on $n ranks over $backend == 1 rank" || bad "dion on $n ranks (exit $rc)" "$(cat $tmp/o $tmp/e)"
run $launch $fsdp $common $dion $exact $wire --steps 7 --save dfs.ckpt
[ $rc = 0 ] && run $si diff d1.h5 dfs.ckpt model/ --rtol 1e-3 --atol 1e-5
[ $rc = 0 ] && ok "dion: fsdp-train on $n shards over $backend == 1 rank" || bad "dion on $n shards (exit $rc)" "$(cat $tmp/o $tmp/e)"
# psgd-train: plain all-reduce of the gradient buckets, and PowerSGD running.
run $psgd $common --compressor none --steps 8 --save p1.h5
[ $rc = 0 ] && run $launch $psgd $common $wire --compressor none --steps 8 --save pn.h5
[ $rc = 0 ] && run $si diff p1.h5 pn.h5 model/ optim/ $close
[ $rc = 0 ] && ok "psgd-train: all-reduce on $n ranks over $backend == 1 rank" || bad "psgd-train on $n ranks (exit $rc)" "$(cat $tmp/o $tmp/e)"
run $launch $psgd $common $wire --compressor powersgd --steps 8 --metrics psgd.jsonl
[ $rc = 0 ] && [ "$(wc -l <psgd.jsonl)" = 8 ] && ok "psgd-train: PowerSGD on $n ranks over $backend" || bad "PowerSGD on $n ranks (exit $rc)" "$(cat $tmp/e)"

# NCCL refuses two ranks on one GPU: exit 2 on every rank, one line of error (Open MPI's own
# banner about the exit code aside).
if [ "$ngpu" = 1 ] && [ "$dev" = cuda ]; then
  run $mpiexec -n 2 $psgd $common --backend nccl --steps 2
  lines=$(awk '/^-+$/ && length($0) >= 20 { banner = !banner; next } !banner' "$tmp/e")   # (mawk: no {20,})
  if [ $rc = 2 ] && [ "$(grep -c . <<<"$lines")" = 1 ] && grep -q 'NCCL needs a GPU per rank, but ranks 0 and 1' <<<"$lines"
  then ok "--backend nccl, 2 ranks on 1 GPU: exit 2, one line"
  else bad "--backend nccl with 2 ranks on 1 GPU (exit $rc, want 2 and one line)" "$(cat $tmp/e)"; fi
fi

# ---- no host wait inside a step (issue 44 item 4): llama-small on one GPU (a micro-batch takes the
# GPU longer than the host takes to queue it, so that a wait would find the GPU busy), 4
# micro-batches a step; the trainer's debug line counts the host's stalls on the GPU before each
# step's end (the first step uploads RoPE's table and warms the allocator: from the second on, 0) ----
if [ "$dev" = cuda ]; then
  run $psgd --model llama-small --global-batch 8 --micro-batch 2 --lr 1e-3 --eval-every 0 --steps 6 --clip 1 --device cuda --log-level debug
  waits=$(grep -o "the host waited for the GPU [0-9]* time" "$tmp/e" | awk '{print $7}' | tail -n +2 | tr '\n' ' ')
  [ $rc = 0 ] && [ -n "$waits" ] && [ -z "$(echo $waits | tr -d '0 ')" ] \
    && ok "psgd-train on the GPU: the host queues each step without waiting (steps 2-6: ${waits% })" \
    || bad "host waits inside a GPU step (exit $rc): ${waits:-none logged}" "$(grep -i wait "$tmp/e" | head -20)"
else skip "host waits inside a step: a GPU's (--device cpu has none)"; fi

# ---- resume: 20 steps == 10 steps, stop, resume, 10 steps; bit for bit ----
# resume_check NAME LAUNCH... -- ARGS...: the uninterrupted run against the stopped and resumed one.
resume_check() {
  local name=$1; shift
  local launcher=()
  while [ "$1" != -- ]; do launcher+=("$1"); shift; done; shift
  rm -f a.jsonl b.jsonl  # an existing --metrics file is refused
  run "${launcher[@]}" "$@" --steps 20 --save full.ckpt --metrics a.jsonl
  [ $rc = 0 ] || { bad "$name: uninterrupted run (exit $rc)" "$(cat $tmp/e)"; return; }
  rm -rf ck; run "${launcher[@]}" "$@" --steps 20 --stop-at 10 --checkpoint-dir ck --metrics b.jsonl
  [ $rc = 0 ] && [ -e ck/latest ] || { bad "$name: first half (exit $rc)" "$(cat $tmp/e)"; return; }
  run "${launcher[@]}" "$@" --steps 20 --resume ck --save resumed.ckpt --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: resumed half (exit $rc)" "$(cat $tmp/e)"; return; }
  run $si diff full.ckpt resumed.ckpt
  if [ $rc = 0 ] && cmp -s <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl); then ok "$name: resume is exact"
  else bad "$name: resume differs (diff exit $rc)" "$(cat $tmp/o)" "$(diff <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl))"; fi
  rm -rf ck full.ckpt resumed.ckpt
}
resume_check "psgd-train (PowerSGD state) on $dev" -- $psgd $common --compressor powersgd
resume_check "shampoo-train (factors, roots) on $dev" -- $shampoo $common $sham
resume_check "fsdp-train, sharded state on $n ranks over $backend" $launch $fsdp -- $common $wire

# ---- resnet-8 on the GPU ----
rn="--model resnet-8 --optimizer sgd --nesterov --lr 0.05 --log-level warn --eval-every 0"
# The CPU's losses: convolutions, batch norm and pooling on the device, the same seed and images.
if [ "$dev" != cpu ]; then
  run $psgd $rn --global-batch 16 --steps 5 --device cpu --metrics rcpu.jsonl
  [ $rc = 0 ] && run $psgd $rn --global-batch 16 --steps 5 --device $dev --metrics rdev.jsonl
  [ $rc = 0 ] && python3 - rcpu.jsonl rdev.jsonl <<'PY' && ok "resnet-8: the CPU's losses to 1e-3 on $dev" || bad "resnet-8 CPU against $dev (exit $rc)" "$(cat $tmp/e rcpu.jsonl rdev.jsonl)"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"resnet-8: worst relative loss difference {worst:.2e}")
assert len(a) == len(b) == 5 and worst < 1e-3, (a, b)
PY
fi
resume_check "resnet-8 (running statistics) on $dev" -- $psgd $rn --global-batch 16 --device $dev
# Learning: Fashion-MNIST (Debian's dataset-fashion-mnist, or DTK_FASHION_MNIST naming a folder of
# its idx files) on the GPU only: 200 steps of 128 images take minutes on a CPU. Else the
# synthetic mixture on 1x4x4 images: its class means are independent per pixel, which a
# convolutional net with global pooling does not pick out of 32x32 images in a few steps; on 4x4
# its receptive field spans the image (60 steps: loss 2.47 -> 1.37 on the CPU).
fm=${DTK_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
if [ "$dev" = cuda ] && [ -f $fm/train-images-idx3-ubyte.gz ] && $datapack mnist $fm/train-images-idx3-ubyte.gz $fm/train-labels-idx1-ubyte.gz -o fm-train.h5 >/dev/null 2>&1 \
   && $datapack mnist $fm/t10k-images-idx3-ubyte.gz $fm/t10k-labels-idx1-ubyte.gz -o fm-test.h5 >/dev/null 2>&1; then
  run $psgd --model resnet-8 --data fm-train.h5 --val-data fm-test.h5 --global-batch 128 --steps 200 --eval-every 0 \
    --eval-batches 20 --optimizer sgd --nesterov --lr 0.05 --warmup 20 --log-level warn --device $dev --metrics rfm.jsonl
  python3 - rfm.jsonl <<'PY' && ok "resnet-8 on Fashion-MNIST on $dev: over 75% test accuracy" || bad "resnet-8 Fashion-MNIST (exit $rc)" "$(cat $tmp/e)" "$(tail -1 rfm.jsonl)"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"resnet-8, 200 steps of 128: test accuracy {r['val_accuracy']:.4f}")
assert r["step"] == 200 and r["val_accuracy"] > 0.75, r
PY
else
  run $psgd $rn --input-shape 1,4,4 --global-batch 32 --steps 60 --device $dev --metrics rsyn.jsonl
  python3 - rsyn.jsonl <<'PY' && ok "resnet-8 learns synthetic images on $dev" || bad "resnet-8 on synthetic images (exit $rc)" "$(cat $tmp/e)" "$(cat rsyn.jsonl | cut -c1-100)"
import json, math, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]
first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
print(f"resnet-8 on synthetic images: loss {first:.3f} -> {last:.3f}")
assert len(loss) == 60 and all(math.isfinite(x) for x in loss) and last < 0.8 * first
PY
fi
finish
