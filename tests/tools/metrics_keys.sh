#!/usr/bin/env bash
# The metrics schema (lib/dtk/train/metrics.h) is the one list of keys: each training program's
# --help footer is made from it, its runs write exactly those keys (every key the footer names
# appears in some run, none beyond), and its man page names every one of them.
# Usage: metrics_keys.sh "MPIEXEC" TOOLS_DIR MAN_DIR
mpiexec=$1 tools=$2 man=$3
. "$(dirname "$0")/train_lib.sh"
mlp="--model mlp-small --data synthetic"
# Each program's runs between them: llama and a classifier, evaluation steps, and whatever the
# program's placement adds (a compressor; HSDP).
declare -A runs=(
  [psgd-train]="-n 2|$small --compressor powersgd --start-iter 0;-n 2|$mlp --compressor none"
  [shampoo-train]="-n 2|$small;-n 2|$mlp --optimizer adamw"
  [fsdp-train]="-n 2|$small --replicate 2;-n 2|$mlp"
)
for prog in psgd-train shampoo-train fsdp-train; do
  bin=$tools/$prog/$prog
  help=$("$bin" --help | tr '\n' ' ' | grep -o 'Metrics ([^)]*):[^.]*\.' | sed 's/^Metrics ([^)]*)://; s/([^)]*)//g; s/[ .]//g' | tr ',' '\n' | sort -u)
  [ -n "$help" ] || { bad "$prog: no metrics list in --help"; continue; }
  written=""
  IFS=';' read -ra list <<<"${runs[$prog]}"
  for r in "${list[@]}"; do
    run $mpiexec ${r%%|*} "$bin" ${r#*|} --steps 2 --eval-every 1 --global-batch 8
    [ $rc = 0 ] || { bad "$prog ${r#*|}: exit $rc" "$(cat $tmp/e)"; continue; }
    written+=$'\n'$(python3 -c 'import json,sys; [print(k) for l in open(sys.argv[1]) for k in json.loads(l)]' "$tmp/o")
  done
  written=$(echo "$written" | sed '/^$/d' | sort -u)
  extra=$(comm -13 <(echo "$help") <(echo "$written"))
  missing=$(comm -23 <(echo "$help") <(echo "$written"))
  if [ -z "$extra" ] && [ -z "$missing" ]; then ok "$prog: runs write the $(echo "$help" | wc -l) keys --help lists"
  else bad "$prog: written but not in --help: [$extra]; in --help but never written: [$missing]"; fi
  unlisted=""
  for k in $help; do grep -qF "$k" "$man/man1/$prog.1" || unlisted+=" $k"; done
  if [ -z "$unlisted" ]; then ok "$prog: the man page names every key"; else bad "$prog.1 does not name:$unlisted"; fi
done
finish
