#!/usr/bin/env bash
# The bash completion (BUILD_DIR/share/dtk/bash-completion/dtk, configured from
# share/dtk/bash-completion/dtk.in with the list of programs) against the built programs: sourced as
# bash-completion would, COMP_WORDS and COMP_CWORD set, _dtk_complete called, COMPREPLY checked:
# long options from each program's --help; values where the help lists them ({a,b}, [a|b],
# "a, b or c"); files for file options, directories for --*-dir; shard-inspect's and data-pack's
# subcommands and their own options; --opt=value in one word and split at "="; nothing for
# numbers; and every option of every program's --help present in the completion.
# The programs are those of BUILD_DIR/programs.txt (tools/CMakeLists.txt's list), each run as
# BUILD_DIR/tools/<program>/<program>.
#   completion.sh BUILD_DIR
set -u
build=$(realpath "$1")
. "$(dirname "$0")/../common/check_lib.sh"
mapfile -t programs < <(programs "$build")
[ ${#programs[@]} -gt 0 ] || { bad "the list of programs" "$build/programs.txt"; finish; exit 1; }
for p in "${programs[@]}"; do PATH=$build/tools/$p:$PATH; done
. "$build/share/dtk/bash-completion/dtk"
cd "$tmp"
mkdir ckdir && touch run.toml ck.h5 metrics.jsonl

for p in "${programs[@]}"; do
  [ "$(complete -p "$p" 2>/dev/null)" = "complete -F _dtk_complete $p" ] || bad "complete -p $p" "$(complete -p "$p" 2>&1)"
done
ok "_dtk_complete is registered for all ${#programs[@]} programs: ${programs[*]}"

# expect NAME WANT WORD...: completing the last WORD gives exactly WANT (space-separated, in order).
expect() {
  local name=$1 want=$2; shift 2
  COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMPREPLY=()
  _dtk_complete
  local got="${COMPREPLY[*]}"
  [ "$got" = "$want" ] && ok "$name" || bad "$name" "want: $want" "got:  $got"
}
# expect_has NAME WORD... :: ITEM...: the completion contains every ITEM (file names come in
# the directory's order).
expect_has() {
  local name=$1; shift
  local words=() items=() i
  while [ "$1" != :: ]; do words+=("$1"); shift; done
  shift; items=("$@")
  COMP_WORDS=("${words[@]}"); COMP_CWORD=$(( ${#words[@]} - 1 )); COMPREPLY=()
  _dtk_complete
  for i in "${items[@]}"; do
    printf '%s\n' "${COMPREPLY[@]}" | grep -qxF -- "$i" || { bad "$name: no $i" "got: ${COMPREPLY[*]}"; return; }
  done
  ok "$name"
}

expect "long options by prefix" "--compress-ratio --compressor" psgd-train --compr
expect "--compressor's values" "powersgd none topk randomk signum auto" psgd-train --compressor ""
expect "a value by prefix" "topk" psgd-train --compressor t
expect "fsdp-train's --compressor (auto too)" "powersgd none topk randomk signum auto" fsdp-train --compressor ""
expect "fsdp-train's auto options" "--auto-interval --auto-ranks --auto-refresh --auto-resume" fsdp-train --auto-
expect "--model's values, from prose" "llama-1b llama-small llama-tiny llama3-1b llama3-8b" psgd-train --model ll
expect "--model: the Llama 3 presets" "llama3-1b llama3-8b" fsdp-train --model llama3
expect "--opt=value in one word" "--model=resnet-18 --model=resnet-20 --model=resnet-8" psgd-train --model=res
expect "--opt=value split at =" "resnet-18 resnet-20 resnet-8" psgd-train --model = res
expect "--activation-checkpointing's [a|b|c]" "none full selective" fsdp-train --activation-checkpointing ""
expect "--optimizer (shampoo-train)" "adamw sgd shampoo" shampoo-train --optimizer ""
expect "--reshard-after-forward" "default always never" fsdp-train --reshard-after-forward ""
expect "comm-bench -d (short option)" "bf16" comm-bench -d b
expect "comm-bench --op" "allreduce allgather alltoall all" comm-bench --op a
expect "a number: nothing" "" psgd-train --steps ""
expect "an option after an optional value" "--steps" psgd-train --activation-checkpointing --ste
expect "--checkpoint-dir: directories" "ckdir" psgd-train --checkpoint-dir ""
expect "--config: files" "run.toml" psgd-train --config r
expect_has "--data: synthetic and files" psgd-train --data "" :: synthetic ck.h5 run.toml
expect_has "--buckets: its words and files" fsdp-train --buckets "" :: param block auto ck.h5
expect "shard-inspect: subcommands" "ls show stats diff verify consolidate reshard convert extract export" shard-inspect ""
expect "shard-inspect: a subcommand by prefix" "reshard" shard-inspect re
expect "data-pack: subcommands" "text tokens mnist cifar10 synthetic" data-pack ""
expect_has "shard-inspect reshard: its options and the common ones" shard-inspect reshard -- :: \
  --world-size --output --force --gzip --log-level
expect "shard-inspect diff --r" "--rtol" shard-inspect --log-level warn diff --r
expect "shard-inspect export --format" "safetensors npz hf" shard-inspect export --format ""
expect_has "shard-inspect ls: a checkpoint file or directory" shard-inspect ls c :: ck.h5 ckdir
expect "shard-inspect convert --dtype" "bf16 f16 f32" shard-inspect convert ck.h5 --dtype ""
expect "data-pack synthetic --kind" "tokens classes" data-pack synthetic --kind ""
expect "data-pack tokens --dtype" "u8 u16 u32 i32 i64" data-pack tokens --dtype ""
expect "data-pack text -o: files" "metrics.jsonl" data-pack text run.toml -o m
expect "dtk-plot --x" "step time bytes both" dtk-plot --x ""
expect "dtk-plot -o: files" "metrics.jsonl" dtk-plot run.toml -o m
expect "dtk-plot: metrics files" "metrics.jsonl" dtk-plot m
expect "an unknown program path: nothing" "" ./no-such-program --
expect "log levels" "trace debug info warn error critical off" comm-bench --log-level ""

# Every long option in every program's --help (and each subcommand's) is completed.
for p in "${programs[@]}"; do
  subs=("")
  [[ $p == shard-inspect ]] && subs+=(ls show stats diff verify consolidate reshard convert extract export)
  [[ $p == data-pack ]] && subs+=(text tokens mnist cifar10 synthetic)
  for s in "${subs[@]}"; do
    # shellcheck disable=SC2086
    want=$("$p" $s --help | grep -oE '^  (-[A-Za-z], ?)?--[a-z][a-z0-9-]*' | grep -oE -- '--[a-z0-9-]+' | sort -u)
    COMP_WORDS=("$p" $s --); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); COMPREPLY=()
    _dtk_complete
    got=$(printf '%s\n' "${COMPREPLY[@]}" | sort -u)
    missing=$(comm -23 <(echo "$want") <(echo "$got"))
    [ -n "$want" ] && [ -z "$missing" ] && ok "$p${s:+ $s}: all $(wc -l <<<"$want") long options" \
      || bad "$p${s:+ $s}: options not completed" "$missing"
  done
done

finish
