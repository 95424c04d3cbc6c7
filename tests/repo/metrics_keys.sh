#!/usr/bin/env bash
# The metrics schema (lib/dtk/train/metrics.h) is the one list of keys: each training program's
# --help footer is made from it, its runs write exactly those keys (every key the footer names
# appears in some run, none beyond), its man page names every one of them, and so do the
# documentation pages given (each key a word of their code spans), and their list of the keys
# (the code span that starts with `step, loss`, in docs/psgd-train.md) has every key psgd-train
# writes for a llama (the others: classifiers' keys, in the text after it, and fsdp-train's, in
# docs/fsdp-train.md).
# Usage: metrics_keys.sh "MPIEXEC" TOOLS_DIR MAN_DIR [DOC.md...]
mpiexec=$1 tools=$(realpath "$2") man=$(realpath "$3")
pages=(); for p in "${@:4}"; do pages+=("$(realpath "$p")"); done
# The words of the pages' code spans (`...`, across lines; fenced blocks left out), or with
# `list`, those of their list of the keys.
readme_spans() {
  python3 -c '
import re, sys
text = re.sub(r"^```.*?^```[ \t]*$", "", open(sys.argv[1]).read(), flags=re.S | re.M)
for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
    if sys.argv[2] == "all" or re.match(r"step,\s*loss,", m.group(2)):
        print("\n".join(re.findall(r"[A-Za-z0-9_]+", m.group(2))))' "$readme" "$1" | sort -u
}
. "$(dirname "$0")/../common/train_lib.sh"
readme=""
if [ ${#pages[@]} -gt 0 ]; then
  readme=$tmp/pages.md
  cat "${pages[@]}" >"$readme" || exit 1
  readme_words=$(readme_spans all) readme_list=$(readme_spans list)
fi
mlp="--model mlp-small --data synthetic"
# Each program's runs between them: llama and a classifier, evaluation and checkpoint steps, and
# whatever the program's placement adds (a compressor; HSDP).
declare -A runs=(
  [psgd-train]="-n 2|$small --compressor powersgd --start-iter 0;-n 2|$small --compressor none --sync diloco --sync-every 2;-n 2|$mlp --compressor none --optimizer shampoo;-n 2|$mlp --compressor auto --start-iter 1"
  [shampoo-train]="-n 2|$small;-n 2|$mlp --optimizer adamw"
  [fsdp-train]="-n 2|$small --replicate 2 --compressor powersgd --start-iter 0;-n 2|$small --replicate 2 --sync diloco --sync-every 2;-n 2|$mlp --optimizer shampoo;-n 2|$mlp --replicate 2 --compressor auto --start-iter 1"
)
for prog in psgd-train shampoo-train fsdp-train; do
  bin=$tools/$prog/$prog
  help=$("$bin" --help | tr '\n' ' ' | grep -o 'Metrics ([^)]*):[^.]*\.' | sed 's/^Metrics ([^)]*)://; s/([^)]*)//g; s/[ .]//g' | tr ',' '\n' | sort -u)
  [ -n "$help" ] || { bad "$prog: no metrics list in --help"; continue; }
  written=""
  IFS=';' read -ra list <<<"${runs[$prog]}"
  for r in "${list[@]}"; do
    rm -rf "$tmp/ck"  # a checkpoint at each step: the checkpoint keys
    run $mpiexec ${r%%|*} "$bin" ${r#*|} --steps 2 --eval-every 1 --global-batch 8 --checkpoint-dir "$tmp/ck" --checkpoint-every 1
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
  if [ -n "$readme" ]; then
    unlisted=""
    for k in $help; do grep -qx -- "$k" <<<"$readme_words" || unlisted+=" $k"; done
    if [ -z "$unlisted" ]; then ok "$prog: the documentation names every key"; else bad "the documentation does not name:$unlisted"; fi
  fi
done
if [ -n "$readme" ]; then
  # psgd-train's keys but those of classifiers ("accuracy (classifiers: ...)", ...)
  llama=$("$tools/psgd-train/psgd-train" --help | tr '\n' ' ' | grep -o 'Metrics ([^)]*):[^.]*\.' \
    | sed 's/^Metrics ([^)]*)://; s/\.$//' | tr ',' '\n' | grep -v '(.*classifiers' | sed 's/(.*//; s/ //g' | sort -u)
  absent=$(comm -23 <(echo "$llama") <(echo "$readme_list") | tr '\n' ' ')
  if [ -n "$llama" ] && [ -z "$absent" ]; then ok "the documentation's list of the keys has the $(echo "$llama" | wc -l) of a llama"
  else bad "the documentation's list of the keys (\`step, loss, ...\`) lacks: ${absent:-(no keys in --help)}"; fi
fi
finish
