#!/usr/bin/env bash
# shard-inspect end to end on checkpoints with known contents (written by ckpt-make): listings,
# metadata, statistics, round trips (consolidate, reshard, convert), exports checked by
# independent parsers, HDF5's own tools on what we write, and every kind of bad input.
#   shard_inspect.sh SHARD_INSPECT CKPT_MAKE
set -u
si=$1 mk=$2
. "$(dirname "$0")/../common/check_lib.sh"
check() { local name=$1; shift; if "$@" >"$tmp/chk.log" 2>&1; then ok "$name"; else bad "$name" "$(cat "$tmp/chk.log")"; fi; }
cd "$tmp"

$mk full full.h5 && $mk changed changed.h5 && $mk sharded sh && $mk version v99.h5 99 || { echo "ckpt-make failed"; exit 1; }

# Runs shard-inspect; $rc, $out (stdout) and $err (stderr) hold what happened.
run() { "$si" "$@" >"$tmp/o" 2>"$tmp/e"; rc=$?; out=$(cat "$tmp/o"); err=$(cat "$tmp/e"); }
expect_rc() { local want=$1 name=$2; shift 2; run "$@"; if [ $rc -eq "$want" ]; then ok "$name"; else bad "$name (exit $rc, want $want)" "$out" "$err"; fi; }
json_ok() { python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$tmp/o"; }

# ---- ls ----
run ls full.h5
[ $rc = 0 ] && grep -q '^model/w.bf16 *bf16 *\[9, 4\] *- *72$' <<<"$out" && grep -q '^optim/step *i64 *\[\] ' <<<"$out" \
  && grep -q '^# total: 15 tensors, 48593 bytes' <<<"$out" && ok "ls full" || bad "ls full" "$out" "$err"
run ls sh
[ $rc = 0 ] && grep -q '^model/ramp .*4 shards, dim 0 *40$' <<<"$out" && grep -q '^optim/step .*rank 2 ' <<<"$out" \
  && grep -q '^ranks/1/compress/error .*rank 1 ' <<<"$out" && grep -q '4 shard files' <<<"$out" && ok "ls sharded" || bad "ls sharded" "$out" "$err"
run ls sh/index.h5 --json
[ $rc = 0 ] && python3 - "$tmp/o" <<'PY' && ok "ls --json" || bad "ls --json" "$out" "$err"
import json, sys
d = json.load(open(sys.argv[1]))
t = {x["name"]: x for x in d["tensors"]}
assert d["sharded"] and d["shard_world_size"] == 4 and d["total"] == {"tensors": 15, "bytes": 48593}
assert t["model/ramp"]["sharding"] == {"shards": 4, "dim": 0, "offsets": [0, 4, 4, 7], "lengths": [4, 0, 3, 3]}
assert t["optim/step"]["sharding"] == {"rank": 2} and t["optim/step"]["shape"] == []
assert t["model/empty2"]["shape"] == [3, 0] and t["model/w.f16"]["dtype"] == "f16"
PY

# ---- show ----
run show sh
[ $rc = 0 ] && grep -q '^step  *42$' <<<"$out" && grep -q '^program  *ckpt-make$' <<<"$out" && grep -q '"name":"tiny"' <<<"$out" \
  && grep -q '^shard_file  *rank-00003.h5$' <<<"$out" && grep -q '^schema_version  *1$' <<<"$out" && ok "show" || bad "show" "$out" "$err"
run show full.h5 --json
[ $rc = 0 ] && python3 - "$tmp/o" <<'PY' && ok "show --json" || bad "show --json" "$out" "$err"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["format"] == "dtk-checkpoint" and d["schema_version"] == 1 and d["step"] == 42 and d["world_size"] == 4
assert d["model_config"] == {"name": "tiny", "dim": 5} and d["data_position"]["index"] == 77
assert d["rng_state"]["seed"] == 1234 and d["extra"]["note"] == "test" and d["created"] == "2026-01-02T03:04:05Z"
assert not d["sharded"] and "shard_files" not in d
PY

# ---- stats ----
run stats full.h5 model/ramp model/special optim/step
[ $rc = 0 ] && grep -Eq '^model/ramp +f32 +10 +16.8819 +0 +9 +4.5 +2.87228 +0 +0$' <<<"$out" \
  && grep -Eq '^model/special +f32 +6 +2.23607 +-2 +1 +-0.5 +1.5 +2 +2$' <<<"$out" \
  && grep -Eq '^optim/step +i64 +1 +42 +42 +42 +42 +0 +0 +0$' <<<"$out" && [ "$(grep -vc '^#' <<<"$out")" = 3 ] \
  && ok "stats" || bad "stats" "$out" "$err"
run stats sh --json
[ $rc = 0 ] && python3 - "$tmp/o" <<'PY' && ok "stats --json (sharded)" || bad "stats --json (sharded)" "$out" "$err"
import json, math, sys
d = {t["name"]: t for t in json.load(open(sys.argv[1]))["tensors"]}
assert len(d) == 15
r = d["model/ramp"]
assert r["numel"] == 10 and r["min"] == 0 and r["max"] == 9 and r["mean"] == 4.5
assert abs(r["l2"] - math.sqrt(285)) < 1e-12 and abs(r["std"] - math.sqrt(8.25)) < 1e-12
assert d["model/empty"]["numel"] == 0 and d["model/empty"]["mean"] is None
u = d["model/bytes.u8"]
assert u["max"] == max(i * 19 % 256 for i in range(13)) and u["mean"] == sum(i * 19 % 256 for i in range(13)) / 13
PY

# ---- diff ----
expect_rc 0 "diff full vs sharded: same" diff full.h5 sh
run diff full.h5 changed.h5
[ $rc = 1 ] && grep -Eq '^model/w.f32 +different +1 .* 1 +f32' <<<"$out" && grep -Eq '^model/w.f64 +same' <<<"$out" \
  && ok "diff names the changed tensor (exit 1)" || bad "diff changed (exit $rc)" "$out" "$err"
expect_rc 0 "diff --atol 1 accepts it" diff full.h5 changed.h5 --atol 1
run diff changed.h5 sh --json
[ $rc = 1 ] && python3 - "$tmp/o" <<'PY' && ok "diff --json" || bad "diff --json" "$out" "$err"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["same"] is False and d["different"] == 1 and d["compared"] == 15
t = {x["name"]: x for x in d["tensors"]}
assert t["model/w.f32"]["result"] == "different" and t["model/w.f32"]["max_abs"] == 1 and t["model/w.f32"]["differing"] == 1
assert t["model/special"]["result"] == "same"
PY

# ---- verify ----
run verify sh
[ $rc = 0 ] && grep -q '^# ok: 15 tensors, 48593 bytes, 4 shard files$' <<<"$out" && ok "verify sharded" || bad "verify sharded" "$out" "$err"
expect_rc 0 "verify full" verify full.h5
run verify full.h5 --json
[ $rc = 0 ] && json_ok && ok "verify --json" || bad "verify --json" "$out" "$err"

# ---- round trips ----
expect_rc 0 "consolidate" consolidate sh -o cons.h5
[ "$out" = cons.h5 ] && ok "consolidate prints the path" || bad "consolidate path" "$out"
expect_rc 0 "consolidate is the identity" diff full.h5 cons.h5
check "h5diff accepts the consolidated file" h5diff full.h5 cons.h5
check "h5dump reads the consolidated file" h5dump -H cons.h5
for nm in "1 3" "4 7" "2 20" "3 1" "5 2"; do
  set -- $nm; n=$1 m=$2
  "$si" reshard full.h5 -n $n -o a$n-$m >/dev/null 2>&1 && "$si" reshard a$n-$m --world-size $m -o b$n-$m >/dev/null 2>&1 \
    && "$si" reshard b$n-$m -n $n -o c$n-$m >/dev/null 2>&1 && "$si" diff -q a$n-$m c$n-$m && "$si" diff -q full.h5 b$n-$m \
    && [ "$(ls b$n-$m | grep -c '^rank-')" = $m ] && ok "reshard $n -> $m -> $n is the identity" || bad "reshard $n -> $m -> $n"
done
run ls b2-20
grep -q '^model/ramp .*20 shards, dim 0' <<<"$out" && grep -q '^optim/step .*rank 0 ' <<<"$out" && ok "reshard to more ranks than rows" || bad "reshard to 20" "$out"
python3 - b2-20/index.h5 <<'PY' || true
PY
run ls b2-20 --json
python3 - "$tmp/o" <<'PY' && ok "reshard splits evenly, first ranks get the extra row" || bad "reshard split" "$out"
import json, sys
t = {x["name"]: x for x in json.load(open(sys.argv[1]))["tensors"]}
assert t["model/ramp"]["sharding"]["lengths"] == [1] * 10 + [0] * 10
assert t["model/w.f32"]["sharding"]["lengths"] == [1] * 7 + [0] * 13
assert t["model/big"]["sharding"]["lengths"] == [15] * 20
PY
expect_rc 0 "verify resharded" verify c4-7
check "h5dump reads the index" h5dump -H c4-7/index.h5
check "h5dump reads a rank file" h5dump -H c4-7/rank-00003.h5
# (The groups, not the root: each write has its own state_id.)
for g in /model /optim; do
  check "h5diff reads the index's virtual datasets ($g)" h5diff -r a4-7/index.h5 c4-7/index.h5 $g
done
expect_rc 0 "consolidate a resharded state" consolidate b5-2 -o cons2.h5
expect_rc 0 "... the same as the original" diff full.h5 cons2.h5

expect_rc 0 "convert to bf16" convert full.h5 --dtype bf16 -o bf16.h5
run ls bf16.h5
grep -Eq '^model/w.f64 +bf16 +\[6, 3\] +- +36$' <<<"$out" && grep -Eq '^model/ids.i32 +i32 ' <<<"$out" && grep -Eq '^model/w.f16 +bf16 ' <<<"$out" \
  && ok "convert converts floats only" || bad "convert dtypes" "$out"
check "h5dump reads bf16 data" h5dump -d /model/w.f64 bf16.h5
"$si" convert bf16.h5 --dtype f32 -o back.h5 >/dev/null 2>&1 && "$si" convert full.h5 --dtype f32 -o f32.h5 >/dev/null 2>&1
expect_rc 0 "bf16 round trip within bf16's error bound" diff --rtol 0.0079 f32.h5 back.h5
expect_rc 1 "... but not exact" diff -q f32.h5 back.h5
expect_rc 0 "convert a sharded state" convert sh --dtype f16 -o shf16
[ -f shf16/index.h5 ] && [ -f shf16/rank-00003.h5 ] && "$si" ls shf16 | grep -q '^optim/step .*rank 2 ' && ok "convert keeps the layout" || bad "convert sharded layout"
expect_rc 0 "verify converted sharded state" verify shf16

expect_rc 0 "extract" extract sh model/ramp optim/step -o ex.h5
run ls ex.h5
[ "$(grep -vc '^#' <<<"$out")" = 2 ] && "$si" show ex.h5 | grep -q '^step  *42$' && ok "extract keeps only those, same metadata" || bad "extract" "$out"
run extract full.h5 optim/ -o exg.h5
[ $rc = 0 ] && run ls exg.h5 && ! grep -q '^model/' <<<"$out" && grep -q '^optim/' <<<"$out" && ok "extract a group (optim/)" || bad "extract group" "$out" "$err"
run stats full.h5 optim/ model/ramp
[ $rc = 0 ] && grep -q '^optim/step ' <<<"$out" && grep -q '^model/ramp ' <<<"$out" && ! grep -q '^model/w' <<<"$out" && ok "stats of a group and a tensor" || bad "stats group" "$out" "$err"
expect_rc 1 "diff reports tensors only in A" diff full.h5 ex.h5
grep -Eq '^model/w.f32 +only-in-a' <<<"$out" && ok "... and names them" || bad "only-in-a" "$out"

# ---- export ----
expect_rc 0 "export safetensors" export sh --format safetensors -o m.safetensors
"$si" stats full.h5 --json >stats.json 2>/dev/null
python3 - m.safetensors stats.json <<'PY' && ok "safetensors header and data" || bad "safetensors" "$(python3 - m.safetensors stats.json 2>&1 <<<'')"
import json, math, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
assert n % 8 == 0
h = json.loads(raw[8:8 + n])
data = raw[8 + n:]
meta = h.pop("__metadata__")
assert meta["format"] == "dtk-checkpoint" and meta["step"] == "42" and json.loads(meta["model_config"])["name"] == "tiny"
assert all(isinstance(v, str) for v in meta.values())
size = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "U8": 1, "U16": 2}
fmt = {"F32": "f", "F64": "d", "F16": "e", "I32": "i", "I64": "q", "U8": "B", "U16": "H"}
end = 0
stats = {t["name"]: t for t in json.load(open(sys.argv[2]))["tensors"]}
for name, t in h.items():  # header order is data order
    b, e = t["data_offsets"]
    assert b == end, (name, b, end)
    numel = math.prod(t["shape"])
    assert e - b == numel * size[t["dtype"]], name
    end = e
    buf = data[b:e]
    if t["dtype"] == "BF16":
        vals = [struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in struct.unpack("<%dH" % numel, buf)]
    else:
        vals = list(struct.unpack("<%d%s" % (numel, fmt[t["dtype"]]), buf))
    s = stats[name]
    assert s["numel"] == numel and t["shape"] == s["shape"], name
    fin = [v for v in vals if math.isfinite(v)]
    if fin:
        assert min(fin) == s["min"] and max(fin) == s["max"], name
        assert abs(sum(fin) / len(fin) - s["mean"]) <= 1e-9 * max(1, abs(s["mean"])), name
assert end == len(data)
assert h["model/ramp"]["dtype"] == "F32" and h["optim/step"]["shape"] == [] and h["model/w.bf16"]["dtype"] == "BF16"
assert list(struct.unpack("<10f", data[h["model/ramp"]["data_offsets"][0]:][:40])) == [float(i) for i in range(10)]
PY
expect_rc 0 "export npz" export full.h5 --format npz -o m.npz
python3 - m.npz m.safetensors <<'PY' && ok "npz loads (zipfile + .npy headers) and matches safetensors" || bad "npz"
import ast, json, math, struct, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
assert z.testzip() is None  # every CRC-32 right
raw = open(sys.argv[2], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n]); h.pop("__metadata__")
data = raw[8 + n:]
names = sorted(i.filename for i in z.infolist())
assert names == sorted(k + ".npy" for k in h), names
for info in z.infolist():
    assert info.compress_type == zipfile.ZIP_STORED
    b = z.read(info)
    assert b[:6] == b"\x93NUMPY" and b[6] in (1, 2)
    hl = struct.unpack("<H", b[8:10])[0] if b[6] == 1 else struct.unpack("<I", b[8:12])[0]
    start = (10 if b[6] == 1 else 12) + hl
    assert start % 64 == 0 and b[start - 1:start] == b"\n"
    d = ast.literal_eval(b[10 if b[6] == 1 else 12:start].decode("latin1"))
    t = h[info.filename[:-4]]
    assert list(d["shape"]) == t["shape"] and d["fortran_order"] is False
    want = {"F32": "<f4", "F64": "<f8", "BF16": "<f4", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "|u1", "U16": "<u2"}[t["dtype"]]
    assert d["descr"] == want, (info.filename, d["descr"])
    body = b[start:]
    sb, se = t["data_offsets"]
    if t["dtype"] == "BF16":  # exported widened to f32: the bf16 bits are its high half
        k = (se - sb) // 2
        assert [x >> 16 for x in struct.unpack("<%dI" % k, body)] == list(struct.unpack("<%dH" % k, data[sb:se]))
        assert all(x & 0xffff == 0 for x in struct.unpack("<%dI" % k, body))
    else:
        assert body == data[sb:se], info.filename
PY

# ---- an npz entry over 4 GiB (zip64), in bounded memory: DTK_TEST_LARGE=1 (6.6 GB of disk) ----
if [ "${DTK_TEST_LARGE:-0}" = 1 ]; then
  "$mk" large large 1100000  # bf16, 2.1 GiB; as f32 in the npz, 4.2 GiB
  /usr/bin/time -f %M -o rss "$si" export large --format npz -o large.npz >/dev/null 2>"$tmp/e" \
    && ok "export npz of 4.2 GiB (peak RSS $(( $(cat rss) / 1024 )) MiB)" || bad "export large" "$(cat "$tmp/e")"
  [ "$(cat rss)" -lt 524288 ] && ok "... under 512 MiB of memory" || bad "export large: peak RSS $(cat rss) KiB"
  python3 - large.npz <<'PY' && ok "... a zip64 entry whose CRC-32 and rows check" || bad "large npz"
import struct, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
i, = z.infolist()
assert i.filename == "model/large.npy" and i.file_size == 128 + 1100000 * 4096 and i.compress_type == zipfile.ZIP_STORED
with z.open(i) as f:  # zipfile checks the CRC-32 at the end of the entry
    f.read(128)
    for r in range(1100000):
        row = f.read(4096)
        if r % 997 == 0: assert struct.unpack_from("<f", row)[0] == r % 256, r
    assert f.read() == b""
PY
  rm -rf large large.npz
fi

# ---- outputs are never overwritten without --force; --force works ----
expect_rc 2 "refuses to overwrite without --force" consolidate sh -o cons.h5
grep -q 'exists; use --force' <<<"$err" && ok "... and says so" || bad "overwrite message" "$err"
expect_rc 0 "--force overwrites" reshard sh -n 2 -o a4-7 --force
[ "$(ls a4-7 | grep -c '^rank-')" = 2 ] && ok "... the sharded state" || bad "--force reshard" "$(ls a4-7)"
expect_rc 2 "refuses to write over the input" convert full.h5 --dtype f16 -o full.h5 --force

# ---- bad input: exit 2, the problem named, nothing written ----
printf 'hello' >text.h5
cp full.h5 trunc.h5 && python3 -c "import os,sys; os.truncate('trunc.h5', os.path.getsize('trunc.h5') // 2)"
cp -r sh noshard && rm noshard/rank-00002.h5
flip() {  # flips one byte inside the first chunk of dataset $2 of file $1
  read -r addr size < <("$mk" chunk "$1" "$2") && python3 - "$1" "$((addr + size / 2))" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2])); c = f.read(1); f.seek(int(sys.argv[2])); f.write(bytes([c[0] ^ 0x10]))
PY
}
cp full.h5 flip.h5 && flip flip.h5 model/big
cp -r sh flipsh && flip flipsh/rank-00001.h5 model/big
mkdir emptydir
cases=("missing.h5|no such file" "text.h5|not an HDF5 file" "trunc.h5|truncated" "v99.h5|schema version 99"
       "noshard|rank-00002.h5 is missing" "flip.h5|model/big" "flipsh|model/big" "emptydir|index.h5")
for c in "${cases[@]}"; do
  input=${c%%|*} msg=${c#*|}
  for cmd in "verify $input" "stats $input" "diff full.h5 $input" "consolidate $input -o out.h5" \
             "reshard $input -n 3 -o outdir" "export $input --format npz -o out.npz" "export $input --format safetensors -o out.st"; do
    # Damaged data is found when it is read: ls and show need only the metadata.
    run $cmd
    left=$(ls -A | grep -E '^(out|\.out)' || true)
    if [ $rc = 2 ] && grep -q -- "$msg" <<<"$err" && [ -z "$left" ]; then ok "bad input: $cmd"; else bad "bad input: $cmd (exit $rc, left: $left)" "$err"; fi
    rm -rf out.h5 outdir out.npz out.st
  done
done
for c in "missing.h5|no such file" "text.h5|not an HDF5" "v99.h5|schema version 99" "noshard|is missing"; do
  input=${c%%|*} msg=${c#*|}
  for cmd in "ls $input" "show $input"; do
    run $cmd
    [ $rc = 2 ] && grep -q -- "$msg" <<<"$err" && [ -z "$out" ] && ok "bad input: $cmd" || bad "bad input: $cmd (exit $rc)" "$out" "$err"
  done
done

# ---- usage ----
expect_rc 2 "no subcommand" 
expect_rc 2 "unknown tensor" stats full.h5 model/nope
grep -q 'model/nope' <<<"$err" && ok "... named" || bad "unknown tensor message" "$err"
expect_rc 2 "extract of an unknown tensor" extract full.h5 model/nope -o out.h5
[ ! -e out.h5 ] && ok "... writes nothing" || bad "extract unknown left out.h5"
expect_rc 2 "bad --dtype" convert full.h5 --dtype i32 -o out.h5
expect_rc 2 "--world-size 0" reshard full.h5 -n 0 -o outdir
expect_rc 2 "output directory missing" consolidate sh -o no/such/dir.h5
expect_rc 0 "--help" --help
grep -q reshard <<<"$out" && ok "--help lists the subcommands" || bad "--help" "$out"
expect_rc 0 "--version" --version
left=$(ls -A | grep -E '\.tmp' || true)
[ -z "$left" ] && ok "no temporary files left" || bad "temporary files left" "$left"

finish
