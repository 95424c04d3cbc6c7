#!/usr/bin/env bash
# data-pack end to end: text, MNIST idx (plain and gzip) and CIFAR-10 records packed and read back
# with HDF5's own tools (h5ls, h5dump, h5diff), the synthetic data materialised, token ids above
# 65535 (u32 files that psgd-train, beside data-pack in the build, trains on, checkpoints and
# resumes from), and bad input (missing files, bad magic numbers, truncated records, bad options)
# exiting 2 without output.
#   data_pack.sh DATA_PACK   (psgd-train: DATA_PACK/../../psgd-train/psgd-train, as the build lays them)
set -u
dp=$(realpath "$1")
. "$(dirname "$0")/../common/check_lib.sh"
cd "$tmp"

# Runs data-pack; $rc, $out (stdout) and $err (stderr) hold what happened.
run() { "$dp" "$@" >"$tmp/o" 2>"$tmp/e"; rc=$?; out=$(cat "$tmp/o"); err=$(cat "$tmp/e"); }
# The raw little-endian bytes of a dataset, as a file.
raw() { h5dump -d "$2" -b LE -o "$3" "$1" >/dev/null 2>&1; }
# Bad input: exit 2, a message naming the problem, no output and no temporary file left.
expect_bad() {
  local name=$1 want=$2 outfile=$3; shift 3
  run "$@"
  if [ $rc -eq 2 ] && grep -q -- "$want" <<<"$err" && [ ! -e "$outfile" ] && [ -z "$(ls -A | grep '\.tmp-')" ]; then
    ok "$name"
  else
    bad "$name (exit $rc, want 2 and '$want', no $outfile)" "$out" "$err" "$(ls -A)"
  fi
}

# ---- text ----
printf 'Hello, world!\n' > a.txt
printf '\x00\xff\x80abc' > b.bin
run text a.txt b.bin -o text.h5
[ $rc = 0 ] && [ "$out" = "text.h5" ] && h5ls text.h5 | grep -Eq '^tokens +Dataset \{20\}$' \
  && h5dump -a /vocab_size text.h5 | grep -q '(0): 256' && h5dump -H -d /tokens text.h5 | grep -q 'H5T_STD_U16LE' \
  && ok "text: 20 byte tokens, vocab_size 256, u16" || bad "text" "$out" "$err" "$(h5ls text.h5 2>&1)"
raw text.h5 /tokens text.raw
python3 - <<'PY' && ok "text: tokens are the bytes, in order" || bad "text tokens"
import struct
want = open("a.txt", "rb").read() + open("b.bin", "rb").read()
got = struct.unpack("<%dH" % len(want), open("text.raw", "rb").read())
assert list(got) == list(want), (got, want)
PY

python3 -c 'import sys; sys.stdout.write("".join(chr(97 + i % 26) for i in range(1000)))' > long.txt
run text long.txt -o train.h5 --val-fraction 0.1 --val-output val.h5
[ $rc = 0 ] && [ "$out" = $'train.h5\nval.h5' ] && h5ls train.h5 | grep -Eq '^tokens +Dataset \{900\}$' \
  && h5ls val.h5 | grep -Eq '^tokens +Dataset \{100\}$' && h5dump -a /split val.h5 | grep -q '"validation"' \
  && ok "text: --val-fraction splits off the end" || bad "text val split" "$out" "$err"
raw val.h5 /tokens val.raw
python3 -c '
import struct; d = open("val.raw", "rb").read(); t = struct.unpack("<100H", d)
assert bytes(t) == open("long.txt", "rb").read()[900:]' && ok "text: validation tokens are the last 10%" || bad "val tokens"

# ---- mnist (idx) ----
python3 - <<'PY'
import struct
n, r, c = 3, 4, 5
img = bytes((i * 37 + 11) % 256 for i in range(n * r * c))
open("img-idx3-ubyte", "wb").write(struct.pack(">IIII", 0x803, n, r, c) + img)
open("lab-idx1-ubyte", "wb").write(struct.pack(">II", 0x801, n) + bytes([7, 0, 9]))
open("img.expected", "wb").write(img)
# bad ones
open("badmagic-idx3", "wb").write(struct.pack(">IIII", 0x801, n, r, c) + img)
open("trunc-idx3", "wb").write(struct.pack(">IIII", 0x803, n, r, c) + img[:-1])
open("short-idx1", "wb").write(struct.pack(">II", 0x801, 2) + bytes([1, 2]))
open("badlabel-idx1", "wb").write(struct.pack(">II", 0x801, n) + bytes([7, 10, 9]))
PY
run mnist img-idx3-ubyte lab-idx1-ubyte -o mnist.h5
[ $rc = 0 ] && [ "$out" = "mnist.h5" ] && h5ls mnist.h5 | grep -Eq '^images +Dataset \{3, 4, 5, 1\}$' \
  && h5ls mnist.h5 | grep -Eq '^labels +Dataset \{3\}$' && h5dump -d /labels mnist.h5 | grep -q '(0): 7, 0, 9' \
  && h5dump -a /classes mnist.h5 | grep -q '(0): 10' && ok "mnist: images [3,4,5,1], labels, classes" \
  || bad "mnist" "$out" "$err" "$(h5dump mnist.h5 2>&1 | head -40)"
raw mnist.h5 /images mnist.raw
cmp -s mnist.raw img.expected && ok "mnist: pixels unchanged" || bad "mnist pixels"
gzip -k img-idx3-ubyte lab-idx1-ubyte
run mnist img-idx3-ubyte.gz lab-idx1-ubyte.gz -o mnistgz.h5
[ $rc = 0 ] && h5diff mnist.h5 mnistgz.h5 /images /images >/dev/null && h5diff mnist.h5 mnistgz.h5 /labels /labels >/dev/null \
  && ok "mnist: .gz inputs give the same data" || bad "mnist gz" "$out" "$err"

# ---- cifar10 ----
python3 - <<'PY'
import struct
recs, hwc = b"", []
for n in range(2):
    chw = bytes((n * 101 + i * 7) % 256 for i in range(3072))
    recs += bytes([n * 3 + 1]) + chw
    hwc += [chw[c * 1024 + p] for p in range(1024) for c in range(3)]
open("batch.bin", "wb").write(recs)
open("cifar.expected", "wb").write(bytes(hwc))
open("trunc.bin", "wb").write(recs[:-5])
open("badlabel.bin", "wb").write(bytes([12]) + recs[1:3073])
PY
run cifar10 batch.bin batch.bin -o cifar.h5
[ $rc = 0 ] && [ "$out" = "cifar.h5" ] && h5ls cifar.h5 | grep -Eq '^images +Dataset \{4, 32, 32, 3\}$' \
  && h5dump -d /labels cifar.h5 | grep -q '(0): 1, 4, 1, 4' && ok "cifar10: 4 records, NHWC, labels" \
  || bad "cifar10" "$out" "$err" "$(h5ls cifar.h5 2>&1)"
raw cifar.h5 /images cifar.raw
python3 -c '
e = open("cifar.expected", "rb").read(); g = open("cifar.raw", "rb").read()
assert g == e + e, "CHW -> HWC conversion wrong"' && ok "cifar10: CHW records stored HWC" || bad "cifar10 layout"

# ---- synthetic ----
run synthetic --kind tokens --samples 50 --seq-len 16 --vocab 64 --seed 3 -o syn.h5
[ $rc = 0 ] && h5ls syn.h5 | grep -Eq '^tokens +Dataset \{801\}$' && h5dump -a /entropy_rate syn.h5 | grep -q 'H5T_IEEE_F64LE' \
  && h5dump -a /vocab_size syn.h5 | grep -q '(0): 64' && ok "synthetic tokens: samples*seq_len+1 tokens, entropy rate" \
  || bad "synthetic tokens" "$out" "$err"
run synthetic --kind tokens --samples 50 --seq-len 16 --vocab 64 --seed 3 -o syn2.h5
h5diff syn.h5 syn2.h5 >/dev/null && ok "synthetic tokens: deterministic" || bad "synthetic determinism"
run synthetic --kind tokens --samples 50 --seq-len 16 --vocab 64 --seed 3 --validation -o synv.h5
! h5diff syn.h5 synv.h5 /tokens /tokens >/dev/null 2>&1 && ok "synthetic tokens: validation stream differs" || bad "synthetic validation"
run synthetic --kind classes --samples 300 --input-dim 12 --classes 4 -o cls.h5
[ $rc = 0 ] && h5ls cls.h5 | grep -Eq '^features +Dataset \{300, 12\}$' && h5ls cls.h5 | grep -Eq '^labels +Dataset \{300\}$' \
  && h5dump -a /classes cls.h5 | grep -q '(0): 4' && h5dump -a /optimal_loss cls.h5 | grep -q 'H5T_IEEE_F64LE' \
  && ok "synthetic classes: features, labels, Bayes loss" || bad "synthetic classes" "$out" "$err"

# ---- token ids above 65535 (Llama 3's vocabulary has 128256) ----
# The language over 70000 tokens is stored u32 (a vocabulary up to 65536 keeps u16, as text's
# 256 above), its ids run past 65535 and stay below vocab_size.
run synthetic --kind tokens --samples 24 --seq-len 16 --vocab 70000 --seed 5 -o big.h5
[ $rc = 0 ] && h5dump -H -d /tokens big.h5 | grep -q 'H5T_STD_U32LE' && h5dump -a /vocab_size big.h5 | grep -q '(0): 70000' \
  && ok "synthetic tokens, vocab 70000: u32" || bad "synthetic tokens, vocab 70000" "$out" "$err" "$(h5dump -H big.h5 2>&1)"
run synthetic --kind tokens --samples 24 --seq-len 16 --vocab 65536 --seed 5 -o edge.h5
[ $rc = 0 ] && h5dump -H -d /tokens edge.h5 | grep -q 'H5T_STD_U16LE' && ok "synthetic tokens, vocab 65536: u16" \
  || bad "synthetic tokens, vocab 65536" "$out" "$err"
raw big.h5 /tokens big.raw
python3 - <<'PY' && ok "vocab 70000: 385 ids, some above 65535, all below 70000" || bad "vocab 70000 ids"
import struct
d = open("big.raw", "rb").read()
t = struct.unpack("<%dI" % (len(d) // 4), d)
assert len(t) == 24 * 16 + 1, len(t)
assert 65535 < max(t) < 70000 and sum(x > 65535 for x in t) >= 5, (max(t), sum(x > 65535 for x in t))
PY
# A llama of that vocabulary trains on the file: a finite loss from about ln 70000 down, a
# checkpoint holding the 70000-row embedding, and a run stopped at step 3 and resumed from its
# checkpoint equal to the run that never stopped.
psgd=$(dirname "$(dirname "$dp")")/psgd-train/psgd-train
si=$(dirname "$(dirname "$dp")")/shard-inspect/shard-inspect
if [ -x "$psgd" ] && [ -x "$si" ]; then
  job="--model llama-tiny --dim 32 --layers 1 --heads 2 --kv-heads 1 --ffn-hidden 64 --vocab 70000 --seq-len 16
       --data big.h5 --global-batch 4 --steps 6 --lr 1e-2 --warmup 1 --eval-every 0 --log-level warn"
  # shellcheck disable=SC2086
  if "$psgd" $job --metrics full.jsonl --save full.h5 >/dev/null 2>"$tmp/e" && python3 - full.jsonl <<'PY'
import json, math, sys
loss = [json.loads(l)["loss"] for l in open(sys.argv[1])]
assert len(loss) == 6 and all(math.isfinite(x) for x in loss), loss
assert abs(loss[0] - math.log(70000)) < 0.2 and min(loss[1:]) < loss[0] - 0.01, loss
PY
  then ok "psgd-train, vocab 70000 on the u32 file: the loss finite, from ln 70000 down"
  else bad "psgd-train, vocab 70000" "$(cat "$tmp/e")" "$(cat full.jsonl 2>/dev/null)"; fi
  if "$si" show --json full.h5 >show.json 2>"$tmp/e" && "$si" ls --json full.h5 >ls.json 2>>"$tmp/e" \
     && python3 - show.json ls.json <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["model_config"]["vocab"] == 70000, s["model_config"]
shapes = {t["name"]: t["shape"] for t in json.load(open(sys.argv[2]))["tensors"]}
assert shapes["model/tok_embeddings.weight"] == [70000, 32] and shapes["model/output.weight"] == [70000, 32], shapes
PY
  then ok "the checkpoint: vocab 70000, tok_embeddings and output [70000, 32]"
  else bad "the checkpoint of vocab 70000" "$(cat "$tmp/e")"; fi
  # shellcheck disable=SC2086
  if "$psgd" $job --stop-at 3 --checkpoint-dir ck --metrics part.jsonl >/dev/null 2>"$tmp/e" \
     && "$psgd" --resume ck --metrics part.jsonl --save resumed.h5 >/dev/null 2>>"$tmp/e" \
     && "$si" diff full.h5 resumed.h5 model/ optim/ >/dev/null 2>>"$tmp/e" && python3 - full.jsonl part.jsonl <<'PY'
import json, sys
cols = lambda f: [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in map(json.loads, open(f))]
assert cols(sys.argv[1]) == cols(sys.argv[2]), (cols(sys.argv[1]), cols(sys.argv[2]))
PY
  then ok "vocab 70000: stopped at step 3 and resumed, the run that never stopped (metrics, model and AdamW state)"
  else bad "vocab 70000: stop and resume" "$(cat "$tmp/e")"; fi
else
  bad "no psgd-train or shard-inspect beside data-pack" "$psgd" "$si"
fi

# ---- bad input: exit 2, no output ----
expect_bad "missing input" "nope.txt: no such file" o1.h5 text nope.txt -o o1.h5
expect_bad "bad idx3 magic" "bad magic number 0x00000801" o2.h5 mnist badmagic-idx3 lab-idx1-ubyte -o o2.h5
expect_bad "bad idx1 magic" "bad magic number 0x00000803" o2.h5 mnist img-idx3-ubyte img-idx3-ubyte -o o2.h5
expect_bad "truncated idx3" "(truncated)" o3.h5 mnist trunc-idx3 lab-idx1-ubyte -o o3.h5
expect_bad "label count mismatch" "2 labels for 3 images" o4.h5 mnist img-idx3-ubyte short-idx1 -o o4.h5
expect_bad "mnist label out of range" "label 10 of image 1" o5.h5 mnist img-idx3-ubyte badlabel-idx1 -o o5.h5
head -c 30 img-idx3-ubyte.gz > trunc.gz
expect_bad "truncated gzip" "truncated" o6.h5 mnist trunc.gz lab-idx1-ubyte -o o6.h5
expect_bad "truncated cifar record" "truncated record 1" o7.h5 cifar10 batch.bin trunc.bin -o o7.h5
expect_bad "cifar label out of range" "label 12 of record 0" o8.h5 cifar10 badlabel.bin -o o8.h5
: > empty.txt
expect_bad "empty text" "too few tokens" o9.h5 text empty.txt -o o9.h5
expect_bad "--val-fraction without --val-output" "needs --val-output" o10.h5 text a.txt -o o10.h5 --val-fraction 0.5
expect_bad "output directory missing" "does not exist" nodir/o.h5 text a.txt -o nodir/o.h5
expect_bad "unknown subcommand" "" o11.h5 pack a.txt -o o11.h5
expect_bad "bad --kind" "kind" o12.h5 synthetic --kind words -o o12.h5
cp text.h5 keep.h5
expect_bad "existing output without --force" "exists; use --force" nothing.h5 text long.txt -o keep.h5
cmp -s text.h5 keep.h5 && ok "existing output untouched" || bad "existing output changed"
expect_bad "output would overwrite the input" "would overwrite the input" nothing.h5 text a.txt -o a.txt --force
run text long.txt -o keep.h5 --force
[ $rc = 0 ] && h5ls keep.h5 | grep -Eq '^tokens +Dataset \{1000\}$' && ok "--force replaces the output" || bad "--force" "$out" "$err"

# ---- --help, --version ----
run --help
[ $rc = 0 ] && grep -q 'cifar10' <<<"$out" && ok "--help" || bad "--help" "$out" "$err"
run --version
[ $rc = 0 ] && grep -q 'data-pack (dtk)' <<<"$out" && ok "--version" || bad "--version" "$out" "$err"

finish
