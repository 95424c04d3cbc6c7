#!/usr/bin/env bash
# Token ids from outside: data-pack tokens packs .npy (u8, u16, u32, i32, i64; versions 1 and 2,
# 2-D), llm.c .bin shards (v1 u16, v2 u32 with ids above 65535) and raw files (--dtype), with
# --vocab or the largest id + 1 and a validation split, and refuses bad files (wrong magic,
# truncated, a lying count, negative or too large ids, big-endian .npy) with exit 2 and nothing
# written; data-pack text --sentencepiece gives the ids of Debian's python3-sentencepiece for a
# model that Debian's spm_train makes from the licenses (documents per file or per line, BOS,
# EOS); and the trainers read shards as one stream ('dir/*.bin', a list file, .npy or .bin
# directly): the same losses as the packed file, bit for bit, on 1 and 2 ranks and across a resume.
# The files are written here by python3 (struct: no NumPy needed).
#   data_tokens.sh MPIEXEC DATA_PACK PSGD_TRAIN
set -u
mpiexec=$1 dp=$(realpath "$2") psgd=$(realpath "$3")
. "$(dirname "$0")/../common/check_lib.sh"
cd "$tmp"

run() { "$dp" "$@" >o 2>e; rc=$?; out=$(cat o); err=$(cat e); }
expect_bad() {  # NAME PATTERN OUTFILE ARGS...: exit 2, one line with PATTERN, no output or temporary
  local name=$1 want=$2 outfile=$3; shift 3
  run "$@"
  if [ $rc -eq 2 ] && [ "$(wc -l <e)" = 1 ] && grep -q -- "$want" e && [ ! -e "$outfile" ] && [ -z "$(ls -A | grep '\.tmp-')" ]
  then ok "$name: $(sed 's/.*error: //' e | cut -c1-110)"
  else bad "$name (exit $rc, want 2 and '$want', no $outfile)" "$out" "$err"; fi
}
# ids FILE.h5: the tokens of a dtk token file, one per line (h5dump, HDF5's own tool).
ids() { h5dump -d tokens -y -w 1 -o ids.out "$1" >/dev/null 2>&1 && grep -Eo '[0-9]+' ids.out; }

# ---- the files, written by python3 ----
python3 - <<'PY'
import random, struct
random.seed(7)
toks = [random.randrange(0, 50257) for _ in range(5001)]
open("want.txt", "w").write("\n".join(map(str, toks)) + "\n")
def npy(path, descr, fmt, vals, shape=None, version=1):
    shape = shape or (len(vals),)
    d = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        descr, ", ".join(map(str, shape)) + ("," if len(shape) == 1 else ""))
    prefix = 10 if version == 1 else 12
    h = d + " " * ((64 - (prefix + len(d) + 1) % 64) % 64) + "\n"
    size = struct.pack("<H", len(h)) if version == 1 else struct.pack("<I", len(h))
    open(path, "wb").write(b"\x93NUMPY" + bytes([version, 0]) + size + h.encode() + struct.pack("<%d%s" % (len(vals), fmt), *vals))
def llmc(path, version, vals, count=None):
    f = "H" if version == 1 else "I"
    head = struct.pack("<256i", *([20240520, version, len(vals) if count is None else count] + [0] * 253))
    open(path, "wb").write(head + struct.pack("<%d%s" % (len(vals), f), *vals))
npy("u16.npy", "<u2", "H", toks[:2000])
npy("i64.npy", "<i8", "q", toks[2000:4000], version=2)
npy("i32.npy", "<i4", "i", toks[4000:], shape=(1, 1001))
npy("u4.npy", "<u4", "I", toks)
llmc("v1.bin", 1, toks)
open("ids.u32", "wb").write(struct.pack("<%dI" % len(toks), *toks))
big = [random.randrange(0, 128256) for _ in range(3000)] + [128255]
open("big.txt", "w").write("\n".join(map(str, big)) + "\n")
llmc("v2.bin", 2, big)
npy("u8.npy", "|u1", "B", [3, 1, 4, 1, 5, 9, 2, 6])
# bad ones
npy("neg.npy", "<i8", "q", [5, 7, -1, 2])
npy("huge.npy", "<i8", "q", [5, 2 ** 40])
npy("be.npy", ">u2", "H", [1, 2, 3])
npy("f4.npy", "<f4", "f", [1.0, 2.0])
open("short.npy", "wb").write(open("u16.npy", "rb").read()[:-10])
llmc("lies.bin", 1, toks[:100], count=200)
llmc("v3.bin", 3, toks[:100])
open("magic.bin", "wb").write(struct.pack("<256i", *([20240521, 1, 4] + [0] * 253)) + struct.pack("<4H", 1, 2, 3, 4))
open("odd.u32", "wb").write(b"\x01\x02\x03\x04\x05")
PY

# ---- data-pack tokens ----
run tokens u16.npy i64.npy i32.npy -o npy.h5 --vocab 50257
[ $rc = 0 ] && [ "$out" = npy.h5 ] && diff -q <(ids npy.h5) want.txt >/dev/null && h5dump -a vocab_size npy.h5 | grep -q "50257" \
  && h5dump -H -d tokens npy.h5 | grep -q H5T_STD_U16LE \
  && ok ".npy <u2, <i8 (format 2.0) and <i4 (2-D) concatenated, --vocab 50257, stored u16" || bad ".npy" "$out" "$err"
run tokens v1.bin -o bin.h5 --vocab 50257
[ $rc = 0 ] && diff -q <(ids bin.h5) want.txt >/dev/null && ok "llm.c .bin v1 (u16)" || bad ".bin v1" "$err"
run tokens --dtype u32 ids.u32 -o raw.h5 --vocab 50257
[ $rc = 0 ] && diff -q <(ids raw.h5) want.txt >/dev/null && ok "raw --dtype u32" || bad "raw" "$err"
run tokens u4.npy -o u4.h5 --val-fraction 0.2 --val-output u4v.h5
[ $rc = 0 ] && [ "$out" = $'u4.h5\nu4v.h5' ] && diff -q <(ids u4.h5; ids u4v.h5) want.txt >/dev/null \
  && [ "$(ids u4v.h5 | wc -l)" = 1000 ] \
  && h5dump -a vocab_size u4.h5 | grep -q "(0): $(sort -n want.txt | tail -1 | awk '{print $1 + 1}')" \
  && ok "<u4 with --val-fraction 0.2 (the last 1000 tokens); vocab_size the largest id + 1" || bad "val split" "$err"
run tokens v2.bin -o big.h5 --vocab 128256
[ $rc = 0 ] && diff -q <(ids big.h5) big.txt >/dev/null && h5dump -H -d tokens big.h5 | grep -q H5T_STD_U32LE \
  && ok "llm.c .bin v2 (u32): Llama 3's ids up to 128255, stored u32" || bad ".bin v2" "$err"
run tokens u8.npy -o u8.h5
[ $rc = 0 ] && [ "$(ids u8.h5 | tr '\n' ' ')" = "3 1 4 1 5 9 2 6 " ] && ok "|u1" || bad "u8" "$err"
expect_bad "a negative id" "token -1 at position 2" x.h5 tokens neg.npy -o x.h5
expect_bad "an id beyond 2^32 - 1" "1099511627776 at position 1" x.h5 tokens huge.npy -o x.h5
expect_bad "a big-endian .npy" "'>u2'" x.h5 tokens be.npy -o x.h5
expect_bad "a float .npy" "'<f4'" x.h5 tokens f4.npy -o x.h5
expect_bad "a truncated .npy" "truncated" x.h5 tokens short.npy -o x.h5
expect_bad "a .bin whose count lies" "counts 200 tokens" x.h5 tokens lies.bin -o x.h5
expect_bad "a .bin of version 3" "version 3" x.h5 tokens v3.bin -o x.h5
expect_bad "a .bin with the wrong magic" "neither .npy nor an llm.c .bin" x.h5 tokens magic.bin -o x.h5
expect_bad "a raw file of a part of a token" "not a whole number" x.h5 tokens --dtype u32 odd.u32 -o x.h5
expect_bad "an id not below --vocab" "not below --vocab 50000" x.h5 tokens --dtype u32 ids.u32 -o x.h5 --vocab 50000
expect_bad "--dtype f32" "dtype" x.h5 tokens --dtype f32 ids.u32 -o x.h5
expect_bad "the second output fails: neither is left" "does not exist" x.h5 tokens u4.npy -o x.h5 --val-fraction 0.5 \
  --val-output nodir/v.h5

# ---- data-pack text --sentencepiece: Debian's spm_train, and Debian's python3-sentencepiece as the reference ----
lic=/usr/share/common-licenses
spm_train --input="$lic/GPL-3,$lic/Apache-2.0" --model_prefix=lic --vocab_size=500 --minloglevel=2 >/dev/null 2>&1 \
  || bad "spm_train" "$(ls "$lic")"
sp_check() {  # H5 SPLIT_LINES BOS EOS FILES...: the ids against python3-sentencepiece's
  local h5=$1 lines=$2 bos=$3 eos=$4
  shift 4
  ids "$h5" >got.txt
  /usr/bin/python3 - "$lines" "$bos" "$eos" "$@" <<'PY'
import sys, sentencepiece
lines, bos, eos, files = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4:]
sp = sentencepiece.SentencePieceProcessor(model_file="lic.model")
want = []
for f in files:
    text = open(f, "rb").read().decode("utf-8")
    for doc in ([l for l in text.split("\n") if l] if lines else [text]):
        want += ([sp.bos_id()] if bos else []) + sp.encode(doc) + ([sp.eos_id()] if eos else [])
got = [int(x) for x in open("got.txt")]
assert got == want, (len(got), len(want), next(i for i, (a, b) in enumerate(zip(got, want)) if a != b))
print(len(got))
PY
}
run text --sentencepiece lic.model "$lic/GPL-2" "$lic/BSD" -o sp.h5
[ $rc = 0 ] && n=$(sp_check sp.h5 0 1 0 "$lic/GPL-2" "$lic/BSD") && h5dump -a vocab_size sp.h5 | grep -q "(0): 500" \
  && ok "--sentencepiece: $n ids equal python3-sentencepiece $(/usr/bin/python3 -c 'import sentencepiece as s; print(s.__version__)')'s (a document per file, BOS)" \
  || bad "--sentencepiece" "$err" "$n"
run text --sentencepiece lic.model --split-lines --eos --no-bos "$lic/LGPL-2.1" -o spl.h5
[ $rc = 0 ] && n=$(sp_check spl.h5 1 0 1 "$lic/LGPL-2.1") \
  && ok "--split-lines --eos --no-bos: $n ids equal Python's" || bad "--split-lines" "$err" "$n"
expect_bad "a file that is no SentencePiece model" "not a SentencePiece model" x.h5 text --sentencepiece want.txt want.txt -o x.h5
expect_bad "--eos without --sentencepiece" "apply to --sentencepiece" x.h5 text --eos want.txt -o x.h5

# ---- training on shards: one stream, the same as the packed file ----
mkdir shards
python3 - <<'PY'
import random, struct
random.seed(3)
toks = [random.randrange(0, 300) for _ in range(20000)]
cuts = [0, 7001, 7001, 13337, 20000]  # an empty shard; windows that span two shards
for i in range(4):
    part = toks[cuts[i]:cuts[i + 1]]
    head = struct.pack("<256i", *([20240520, 1, len(part)] + [0] * 253))
    open("shards/train-%02d.bin" % i, "wb").write(head + struct.pack("<%dH" % len(part), *part))
open("all.bin", "wb").write(struct.pack("<256i", *([20240520, 1, len(toks)] + [0] * 253)) + struct.pack("<%dH" % len(toks), *toks))
open("shards.txt", "w").write("# the shards, relative to this list\nshards/train-00.bin\n\nshards/train-01.bin\nshards/train-02.bin\nshards/train-03.bin\n")
PY
run tokens all.bin -o all.h5 --vocab 300
train="--vocab 300 --steps 4 --global-batch 8 --eval-every 0 --log-level warn"
losses() { python3 -c "import json, sys; print(' '.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1])))" "$1"; }
$psgd $train --data all.h5 --metrics ref.jsonl >/dev/null 2>err || bad "psgd-train on the packed file" "$(cat err)"
ref=$(losses ref.jsonl)
for spec in 'shards/train-*.bin' shards.txt all.bin; do
  rm -f m.jsonl
  $psgd $train --data "$spec" --metrics m.jsonl >/dev/null 2>err && [ "$(losses m.jsonl)" = "$ref" ] \
    && ok "--data $spec: the packed file's losses, bit for bit" || bad "--data $spec" "$(cat err)" "$(losses m.jsonl)" "$ref"
done
# (1 and 2 ranks sum the gradient in another order: the same losses to rounding, not bit for bit.)
rm -f m.jsonl m2.jsonl
$mpiexec -n 2 $psgd $train --data all.h5 --metrics m2.jsonl >/dev/null 2>err
$mpiexec -n 2 $psgd $train --data 'shards/train-*.bin' --metrics m.jsonl >/dev/null 2>>err \
  && [ "$(losses m.jsonl)" = "$(losses m2.jsonl)" ] && ok "2 ranks on the shards: the packed file's losses on 2 ranks" \
  || bad "2 ranks on shards" "$(cat err)"
rm -f m.jsonl
$psgd $train --data 'shards/train-*.bin' --stop-at 2 --save half.h5 --metrics m.jsonl >/dev/null 2>err \
  && $psgd $train --data 'shards/train-*.bin' --resume half.h5 --metrics m.jsonl >/dev/null 2>>err \
  && [ "$(losses m.jsonl)" = "$ref" ] && ok "2 steps, a resume, 2 more: the same losses" || bad "resume on shards" "$(cat err)"
trainer_bad() {  # NAME PATTERN SPEC
  $psgd $train --data "$3" --metrics /dev/null >/dev/null 2>e
  [ $? = 2 ] && [ "$(wc -l <e)" = 1 ] && grep -q -- "$2" e && ok "$1: exit 2, $(sed 's/.*error: //' e | cut -c1-100)" \
    || bad "$1" "$(cat e)"
}
trainer_bad "a pattern that matches nothing" "no file matches" 'shards/none-*.bin'
printf 'shards/train-00.bin\nshards/gone.bin\n' >gone.txt
trainer_bad "a list naming a missing file" "gone.bin" gone.txt
cp magic.bin shards/train-04.bin
trainer_bad "a shard with the wrong magic" "train-04.bin: neither" 'shards/train-*.bin'
rm shards/train-04.bin
trainer_bad "ids not below the model's vocab" "not below the model's vocab 300" 'v1.bin'
finish
