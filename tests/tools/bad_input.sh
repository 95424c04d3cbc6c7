#!/usr/bin/env bash
# Bad input across the programs (issue 14), each case exit 2 with one line that names the option
# or file and the problem, on every rank, before any work starts and creating nothing:
#   non-finite features in a data file (--data, --val-data; data-pack's writer refuses them too);
#   a token not below the file's vocab_size, found on every rank, not only where it is read;
#   outputs that cannot be written (--checkpoint-dir through a file, in a read-only directory or
#   under /proc,
#   --metrics or --save where nothing can be written, -o of data-pack and shard-inspect), checked
#   on every rank under mpiexec -n 2; numeric options whose message states the rule
#   ("--steps must be at least 1"); data files that are not HDF5, truncated or incomplete, and
#   --config files that are missing or malformed.
#   bad_input.sh MPIEXEC BIN_DIR   (BIN_DIR/<program>/<program>)
set -u
mpiexec=$1 bin=$(realpath "$2")
. "$(dirname "$0")/../common/train_lib.sh"
psgd=$bin/psgd-train/psgd-train shampoo=$bin/shampoo-train/shampoo-train fsdp=$bin/fsdp-train/fsdp-train
bench=$bin/comm-bench/comm-bench dp=$bin/data-pack/data-pack si=$bin/shard-inspect/shard-inspect
# A read-only directory stays removable when the test ends (chattr +i is how root gets one).
trap 'chattr -i "$tmp/ro" 2>/dev/null; chmod 755 "$tmp/ro" 2>/dev/null; rm -rf "$tmp"' EXIT
common="$small --global-batch 4 --steps 2 --eval-every 0 --log-level warn"
mlp="--model mlp-small --input-dim 8 --classes 2 --global-batch 8 --steps 2 --log-level warn"

# Exit 2 and exactly one line on stderr that contains `msg` (fixed string), nothing on stdout.
one_line() {
  local name=$1 msg=$2; shift 2
  run "$@"
  if [ $rc = 2 ] && grep -qF -- "$msg" "$tmp/e" && [ "$(wc -l <"$tmp/e")" = 1 ] && [ ! -s "$tmp/o" ]; then ok "$name"
  else bad "$name (exit $rc, want 2 and one line with '$msg')" "$(cat "$tmp/o" "$tmp/e")"; fi
}
# Under mpiexec -n 2 with --log-all-ranks: the launcher's exit code is 2, both ranks say `msg`
# (fixed string) and nothing was killed or aborted.
every_rank() {
  local name=$1 prog=$2 msg=$3; shift 3
  run $mpiexec -n 2 "$@" --log-all-ranks
  local said=0 r
  for r in 0 1; do grep -F -- "[$prog $r]" "$tmp/e" | grep -qF -- "$msg" && said=$((said+1)); done
  if [ $rc = 2 ] && [ $said = 2 ] && ! grep -qE "MPI_ABORT|exited on signal|[Kk]illed" "$tmp/e" && [ ! -s "$tmp/o" ]; then ok "$name"
  else bad "$name (exit $rc, $said of 2 ranks said '$msg')" "$(cat "$tmp/o" "$tmp/e")"; fi
}

# A command line or --config error under mpiexec -n 2: exit 2 and rank 0's one line, once (every
# rank parses the same arguments), nothing aborted.
launched() {
  local name=$1 msg=$2; shift 2
  run $mpiexec -n 2 "$@"
  if [ $rc = 2 ] && [ "$(grep -cF -- "$msg" "$tmp/e")" = 1 ] && ! grep -qE "MPI_ABORT|exited on signal|[Kk]illed" "$tmp/e" \
     && [ ! -s "$tmp/o" ]; then ok "$name"
  else bad "$name (exit $rc, want 2 and '$msg' once)" "$(cat "$tmp/o" "$tmp/e")"; fi
}

# ---- data files: a features file made with HDF5's h5import (samples of D floats, labels) ----
# features_file OUT N D BAD_SAMPLE BAD_COLUMN VALUE (BAD_SAMPLE -1: all finite; "nolabels": no labels)
features_file() {
  python3 - "$@" <<'PY'
import struct, sys
out, n, d, row, col, val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
f = [((i * 37) % 11) / 11.0 for i in range(n * d)]
if row >= 0:
    f[row * d + col] = float(val)
open(out + ".f", "wb").write(struct.pack("<%df" % (n * d), *f))
open(out + ".l", "wb").write(struct.pack("<%di" % n, *[i % 2 for i in range(n)]))
conf = "PATH {p}\nINPUT-CLASS {c}\nINPUT-SIZE 32\nINPUT-BYTE-ORDER LE\nRANK {r}\nDIMENSION-SIZES {s}\nOUTPUT-CLASS {c}\nOUTPUT-SIZE 32\nOUTPUT-ARCHITECTURE {a}\nOUTPUT-BYTE-ORDER LE\n"
open(out + ".fc", "w").write(conf.format(p="features", c="FP", r=2, s="%d %d" % (n, d), a="IEEE"))
open(out + ".lc", "w").write(conf.format(p="labels", c="IN", r=1, s="%d" % n, a="STD"))
PY
  if [ "${7:-}" = nolabels ]; then h5import "$1.f" -c "$1.fc" -o "$1" >/dev/null
  else h5import "$1.f" -c "$1.fc" "$1.l" -c "$1.lc" -o "$1" >/dev/null; fi
  rm -f "$1".f "$1".l "$1".fc "$1".lc
}
features_file good.h5 64 8 -1 0 0
features_file nan.h5 64 8 37 2 nan
features_file inf.h5 64 8 5 7 -inf
features_file nolabels.h5 64 8 -1 0 0 nolabels
run $psgd $mlp --data good.h5
[ $rc = 0 ] && ok "a file of finite features trains" || bad "good.h5 (exit $rc)" "$(cat $tmp/e)"

# ---- 1. non-finite features: refused when the file is opened, naming the file and the sample ----
one_line "NaN in --data" 'nan.h5: sample 37 of `features` holds NaN (column 2); features must be finite' \
  $psgd $mlp --data nan.h5
one_line "-inf in --val-data" 'inf.h5: sample 5 of `features` holds -inf (column 7)' \
  $psgd $mlp --data good.h5 --val-data inf.h5
every_rank "NaN in --data, every rank (fsdp-train)" fsdp-train 'nan.h5: sample 37 of `features` holds NaN' \
  $fsdp $mlp --data nan.h5

# ---- out-of-range tokens: a token file (data-pack text, vocab_size 256, tokens stored
# contiguously) with one token patched to 511; the whole file is checked when it is opened, so
# every rank refuses it, not only the one whose batch holds the token ----
python3 -c "open('t.txt', 'w').write('a' * 700)"
$dp text t.txt -o t.h5 --log-level warn >/dev/null
offset=$(h5dump -p -H -d /tokens t.h5 | awk '$1 == "OFFSET" { print $2 }')
python3 - "$offset" <<'PY'
import sys
b = bytearray(open('t.h5', 'rb').read())
at = int(sys.argv[1]) + 2 * 650
assert b[at:at + 2] == b'a\0', 'tokens not where h5dump says'
b[at:at + 2] = (511).to_bytes(2, 'little')
open('badtok.h5', 'wb').write(b)
PY
tok="--model llama-tiny --dim 32 --layers 2 --heads 4 --kv-heads 2 --ffn-hidden 64 --vocab 256 --seq-len 16"
tok="$tok --global-batch 4 --steps 2 --eval-every 0 --log-level warn"
msg="badtok.h5: token 511 at position 650 is not below vocab_size 256"
one_line "token >= vocab_size in --data" "$msg" $psgd $tok --data badtok.h5
one_line "token >= vocab_size in --val-data" "$msg" $psgd $tok --data t.h5 --val-data badtok.h5
every_rank "token >= vocab_size, every rank (psgd-train)" psgd-train "$msg" $psgd $tok --data badtok.h5
every_rank "token >= vocab_size, every rank (shampoo-train)" shampoo-train "$msg" $shampoo $tok --data badtok.h5
every_rank "token >= vocab_size, every rank (fsdp-train)" fsdp-train "$msg" $fsdp $tok --data badtok.h5

# ---- 2. outputs that cannot be written: exit 2 on every rank, before anything is created ----
touch afile
every_rank "--checkpoint-dir through a regular file" psgd-train \
  "--checkpoint-dir afile/ck: cannot be created: afile is not a directory" $psgd $common --checkpoint-dir afile/ck
every_rank "--metrics in a missing directory" psgd-train "--metrics nodir/m.jsonl: the directory nodir does not exist" \
  $psgd $common --metrics nodir/m.jsonl
every_rank "--metrics is a directory (shampoo-train)" shampoo-train "--metrics .: is a directory, not a file" \
  $shampoo $common --metrics .
every_rank "--save in a missing directory (fsdp-train)" fsdp-train "--save nodir/x.h5: the directory nodir does not exist" \
  $fsdp $common --save nodir/x.h5
# A run that fails validation creates no checkpoint directory.
every_rank "--checkpoint-dir with a bad --metrics" psgd-train "--metrics afile/m.jsonl: afile is not a directory" \
  $psgd $common --checkpoint-dir newck --metrics afile/m.jsonl
[ ! -e newck ] && ok "a run that fails validation creates no checkpoint directory" || bad "newck was created"
# Where permission bits say yes but nothing can be made (/proc: root passes access(2) there; it
# used to fail on rank 0 alone, in the run, exit 1 through MPI_ABORT).
every_rank "--checkpoint-dir where nothing can be made (/proc)" psgd-train \
  "--checkpoint-dir /proc/dtk-nope: cannot be created in /proc" $psgd $common --steps 3 --stop-at 2 --checkpoint-dir /proc/dtk-nope
every_rank "--save where nothing can be made (/proc, fsdp-train)" fsdp-train "--save /proc/dtk.h5: cannot write in /proc" \
  $fsdp $common --save /proc/dtk.h5
# A read-only directory: mode 555 (root ignores it: chattr +i, where the file system has it).
mkdir ro
chmod 555 ro
if touch ro/.probe 2>/dev/null; then rm -f ro/.probe; chattr +i ro 2>/dev/null; fi
if ! touch ro/.probe 2>/dev/null; then
  every_rank "--checkpoint-dir in a read-only directory" psgd-train "--checkpoint-dir ro/ck/a: cannot be created in ro" \
    $psgd $common --checkpoint-dir ro/ck/a
  every_rank "--save in a read-only directory" psgd-train "--save ro/x.h5: cannot write in ro" $psgd $common --save ro/x.h5
  run $psgd $small --global-batch 4 --steps 1 --log-level warn --save ck.h5
  [ $rc = 0 ] || bad "a checkpoint for shard-inspect (exit $rc)" "$(cat $tmp/e)"
  one_line "shard-inspect -o in a read-only directory" "-o ro/c.h5: cannot write in ro" $si convert ck.h5 --dtype bf16 -o ro/c.h5
  one_line "data-pack -o in a read-only directory" "-o ro/d.h5: cannot write in ro" \
    $dp synthetic --kind classes --samples 8 -o ro/d.h5
  [ -z "$(ls -A ro)" ] && ok "nothing written in the read-only directory" || bad "ro holds" "$(ls -A ro)"
else
  echo "skip read-only directories: this file system cannot make one"
fi

# ---- 3. numeric options: the message states the rule and names the option, one line ----
one_line "psgd-train --steps 0" "psgd-train: error: --steps must be at least 1" $psgd --steps 0
one_line "psgd-train --lr 0" "psgd-train: error: --lr must be positive" $psgd --lr 0
one_line "psgd-train --lr nan" "psgd-train: error: --lr must be a finite number" $psgd --lr nan
one_line "psgd-train --beta2 1.5" "psgd-train: error: --beta2 must be between 0 and 1" $psgd --beta2 1.5
one_line "psgd-train --compress-ratio 2" "psgd-train: error: --compress-ratio must be at most 1" $psgd --compress-ratio 2
one_line "psgd-train --warmup -1" "psgd-train: error: --warmup must be at least 0" $psgd --warmup -1
one_line "psgd-train --schedule step without decay steps" "error: --schedule step needs --decay-steps" \
  $psgd --schedule step
one_line "psgd-train --decay-steps without --schedule step" "error: --decay-steps needs --schedule step" \
  $psgd --decay-steps 10
one_line "psgd-train --decay-steps not increasing" "error: --decay-steps must increase: 10 follows 20" \
  $psgd --schedule step --decay-steps 20,10
one_line "psgd-train --decay-steps beyond --steps" "error: --decay-steps 300 is not before --steps 300" \
  $psgd --schedule step --decay-steps 100,300
one_line "psgd-train --decay-steps 0" "psgd-train: error: --decay-steps must be at least 1" $psgd --schedule step --decay-steps 0
one_line "psgd-train --comm-timeout 0" "psgd-train: error: --comm-timeout must be positive" $psgd --comm-timeout 0
one_line "shampoo-train --precondition-frequency 0" "shampoo-train: error: --precondition-frequency must be at least 1" \
  $shampoo --precondition-frequency 0
one_line "shampoo-train --grafting-beta2 2" "shampoo-train: error: --grafting-beta2 must be between 0 and 1" \
  $shampoo --grafting-beta2 2
one_line "fsdp-train --prefetch -1" "fsdp-train: error: --prefetch must be at least 0" $fsdp --prefetch -1
one_line "fsdp-train --bucket-memory -1" "fsdp-train: error: --bucket-memory must be a size: bytes with an optional K, M, G or T (powers of 1024), as 25M" $fsdp --bucket-memory -1
one_line "comm-bench --iters 0" "comm-bench: error: --iters must be at least 1" $bench --iters 0
one_line "data-pack --samples 0" "data-pack: error: --samples must be at least 1" \
  $dp synthetic --kind classes --samples 0 -o x.h5
one_line "data-pack --val-fraction 1" "data-pack: error: --val-fraction must be between 0 and 0.999" \
  $dp text afile -o x.h5 --val-fraction 1 --val-output v.h5
one_line "shard-inspect --rtol -1" "shard-inspect: error: --rtol must be at least 0" $si diff a.h5 b.h5 --rtol -1
one_line "shard-inspect --gzip 10" "shard-inspect: error: --gzip must be between 0 and 9" $si convert a.h5 --dtype bf16 -o b.h5 --gzip 10
# Under mpiexec every rank parses the same arguments; rank 0 says it, the launcher's code is 2.
run $mpiexec -n 2 $psgd --steps 0
if [ $rc = 2 ] && [ "$(grep -cF -- "psgd-train: error: --steps must be at least 1" "$tmp/e")" = 1 ] \
  && ! grep -qE "MPI_ABORT|exited on signal|[Kk]illed" "$tmp/e"; then ok "--steps 0 under mpiexec -n 2"
else bad "--steps 0 under mpiexec -n 2 (exit $rc)" "$(cat "$tmp/e")"; fi
# A rank late to the agreed exit (held 2 s, as a loaded node's scheduler may hold one) still
# leaves by itself with the agreed code: mpiexec ends the job at the first non-zero exit and
# SIGTERMs a rank still inside MPI_Finalize (comm::Runtime::finish). Each rank says at debug
# level that it got out.
run env DTK_TEST_EXIT_DELAY=1:2 $mpiexec -n 2 -x DTK_TEST_EXIT_DELAY $psgd $mlp --data missing.h5 --log-level debug \
  --log-all-ranks
if [ $rc = 2 ] && [ "$(grep -c "debug: done with MPI on every rank; exit status 2" "$tmp/e")" = 2 ] \
  && ! grep -qE "MPI_ABORT|exited on signal|[Kk]illed" "$tmp/e"; then ok "a rank late to the agreed exit is not killed"
else bad "a rank late to the agreed exit is not killed (exit $rc)" "$(cat "$tmp/e")"; fi

# ---- 4. data files that are not HDF5, truncated or incomplete; --config files ----
echo "this is not HDF5" > text.h5
head -c 1500 good.h5 > trunc.h5
one_line "--data not HDF5" "text.h5: not an HDF5 file" $psgd $mlp --data text.h5
one_line "--data truncated" "trunc.h5: not an HDF5 file, or a damaged one" $psgd $mlp --data trunc.h5
one_line "--data without labels" 'nolabels.h5: the dataset `labels` is missing' $psgd $mlp --data nolabels.h5
one_line "--val-data not HDF5" "text.h5: not an HDF5 file" $psgd $mlp --data good.h5 --val-data text.h5
one_line "--val-data truncated" "trunc.h5: not an HDF5 file, or a damaged one" $psgd $mlp --data good.h5 --val-data trunc.h5
every_rank "--val-data truncated, every rank" psgd-train "trunc.h5: not an HDF5 file" $psgd $mlp --data good.h5 --val-data trunc.h5
one_line "--config missing" "--config nothere.toml: no such file" $psgd --config nothere.toml
# A --config file is TOML read strictly: whatever does not parse or fit names the file, the line
# and the key (CLI11's own reader trained `steps = [1,` as one step).
printf 'stepz = 3\n' > extra.toml
one_line "--config with an unknown option" "--config extra.toml, line 1: stepz = 3: no option --stepz; did you mean steps?" $psgd --config extra.toml
printf '[unterminated\nsteps 3\n' > bad.toml
one_line "--config malformed" "--config bad.toml, line 1, column 14: not TOML" $psgd --config bad.toml
printf 'lr = 3e-4\nsteps = [1,\n' > open.toml
one_line "--config with an open array" "--config open.toml, line 2, column 13: not TOML" $psgd --config open.toml
launched "--config with an open array, 2 ranks" "--config open.toml, line 2" $psgd --config open.toml
printf 'lr = [0.1\n' > badval.toml
one_line "--config with a malformed value" "--config badval.toml, line 1" $psgd --config badval.toml
printf '# a job\nsteps = "abc"\n' > text.toml
one_line "--config with text for a number" "--config text.toml, line 2: steps = 'abc': --steps must be a finite number" \
  $psgd --config text.toml
launched "--config with text for a number, 2 ranks" "--config text.toml, line 2: steps = 'abc'" $psgd --config text.toml
printf 'steps = 1.5\n' > frac.toml
one_line "--config with a fraction for a count" "--config frac.toml, line 1: steps = 1.5: --steps must be a whole number" \
  $psgd --config frac.toml
printf 'model = llama-tiny\n' > bare.toml
one_line "--config with unquoted text" '(text needs quotes: model = "llama-tiny")' $psgd --config bare.toml
printf 'model = "resnet-8"\ninput-shape = [1, 28]\n' > short.toml
one_line "--config with too few values" "--config short.toml, line 2: input-shape = [ 1, 28 ]: Expected exactly 3" \
  $psgd --config short.toml
printf '[train]\nsteps = 3\n' > section.toml
one_line "--config with a section" "--config section.toml, line 1: [train]: no subcommand train" $psgd --config section.toml
printf 'steps = 0\n' > zero.toml
one_line "--config breaking a rule" "psgd-train: error: --config zero.toml, line 1: steps = 0: --steps must be at least 1" \
  $psgd --config zero.toml
printf 'steps = 2\n' > good.toml
one_line "a value on the command line is its own" "psgd-train: error: --steps must be at least 1" \
  $psgd --config good.toml --steps 0
cp good.toml job.ini
run $psgd --config job.ini --stop-at 1 --save ini.h5 --log-level warn
[ $rc = 0 ] && [ -f ini.h5 ] && ok "an .ini file is read by CLI11's INI reader" || bad "--config job.ini (exit $rc)" "$(cat "$tmp/e")"

# ---- 5. option and subcommand names ----
one_line "an option typo names the closest option" "psgd-train: error: unknown option --step; did you mean --steps?" \
  $psgd --step 5
one_line "an unknown option" "psgd-train: error: unknown option --frobnicate" $psgd --frobnicate
one_line "an unknown subcommand" "shard-inspect: error: unknown subcommand 'lst'; did you mean ls?" $si lst x.h5
one_line "a subcommand typo in data-pack" "data-pack: error: unknown subcommand 'mnits'; did you mean mnist?" $dp mnits a b -o x.h5
# A classifier whose input does not fit the data: the option that fixes it.
one_line "features of another width" "add --input-dim 8 to fit the data" $psgd --model mlp-small --input-dim 4 --classes 2 \
  --data good.h5 --steps 1

finish
