#!/usr/bin/env bash
# The examples of README.md and of the pages in docs/, run as written (issue 28), so that the
# documentation cannot drift from the programs. Every fenced block is classified by its info string, the convention the README states
# under "Running the examples":
#   ```sh                 commands, run as written (eval), in order, in this one shell (an
#                         assignment or export stays); each section (a heading) in a fresh scratch
#                         directory holding links to the repository's build/, share/ and scripts/;
#                         HOME is the scratch directory, whose ~/.local/bin holds the programs (in
#                         place of `cmake --install build --prefix ~/.local`; doc_lib.sh's doc_bin);
#                         Open MPI's variables start unset: the README's own exports set them
#   ```sh REASON...       not run, counted and listed: build, root, slurm, download, long, and gpu
#                         (run when `nvidia-smi -L` lists a GPU and it is the only reason)
#   ```sh append=OPTIONS  run with OPTIONS after the arguments of each psgd-train, shampoo-train,
#                         fsdp-train and comm-bench the block runs; the paragraph before or after
#                         the block must say "the test appends `OPTIONS`"
#   ```console [exit=N]   `$ ` lines run as written; the lines after one are its output (stdout
#                         and stderr): each must appear, in order, in what it printed, compared
#                         with spaces collapsed and what differs between runs masked (mask());
#                         its exit status must be N (0)
#   ```text               output and listings: not run
# A fence without an info string, or an indented code block, is an error: every block is classified.
# A command must exit 0 (set -o pipefail) with sensible output (doc_lib.sh's doc_check: jq printed
# no null, `> FILE` and -o outputs written, metrics with a numeric loss, comm-bench's check passed).
#   readme.sh SOURCE_DIR BUILD_DIR [SECTION_REGEX]
# The commands run in this script's shell: one that assigned a variable of the script's (short
# lower-case names: k, s, c, l, line, type, ...) would confuse it; the README's assign only `f`.
# SECTION_REGEX (grep -E) runs only the sections whose heading matches (and the other sections'
# `export` lines), for trying an edit; DTK_README_KEEP=1 keeps the scratch directory.
set -u
src=$(realpath "$1") build=$(realpath "$2") only=${3:-}
. "$(dirname "$0")/../common/check_lib.sh"
. "$(dirname "$0")/../common/doc_lib.sh"
set -o pipefail
[ -n "${DTK_README_KEEP:-}" ] && trap 'echo "kept $tmp"' EXIT
start=$SECONDS

# ---- parse: sections and blocks, README.md's and then those of the pages in docs/ ----
declare -a b_line=() b_end=() b_info=() b_body=() b_sec=() b_file=()
declare -a sec_title=()
docs=(README.md)
for f in "$src"/docs/*.md; do docs+=("docs/${f##*/}"); done
sec=0
sec_title[0]="(top)"
for doc in "${docs[@]}"; do
  mapfile -t lines <"$src/$doc"
  inblock=0 prevblank=1 body="" info="" first=0
  sec=$((sec + 1)); sec_title[$sec]="$doc"  # a page starts a section
  for i in "${!lines[@]}"; do
    l=${lines[$i]}
    if [ $inblock = 0 ]; then
      if [[ $l =~ ^\`\`\`(.*)$ ]]; then
        inblock=1 info=${BASH_REMATCH[1]} body="" first=$((i + 1))
      elif [[ $l =~ ^#+\ (.*)$ ]]; then
        sec=$((sec + 1)); sec_title[$sec]=${BASH_REMATCH[1]}
      elif [ $prevblank = 1 ] && [[ $l =~ ^\ {4}[^\ -] ]]; then
        bad "$doc:$((i + 1)): an indented code block (fence it with \`\`\`sh or \`\`\`text)" "$l"
      fi
    elif [[ $l == '```' ]]; then
      inblock=0
      b_line+=("$first") b_end+=("$((i + 1))") b_info+=("$info") b_body+=("$body") b_sec+=("$sec") b_file+=("$doc")
    else
      body+=$l$'\n'
    fi
    [[ -z ${l// /} ]] && prevblank=1 || prevblank=0
  done
  [ $inblock = 0 ] || bad "$doc:$first: a fence that never closes"
done

# The paragraph right before line $2 (1-based, a fence) and right after line $3 of file $1, as one line.
beside() {
  local a=$(($2 - 2)) z=$3 text="" lines
  mapfile -t lines <"$src/$1"
  while [ $a -ge 0 ] && [ -z "${lines[$a]// /}" ]; do a=$((a - 1)); done
  while [ $a -ge 0 ] && [ -n "${lines[$a]// /}" ]; do text="${lines[$a]} $text"; a=$((a - 1)); done
  while [ $z -lt ${#lines[@]} ] && [ -z "${lines[$z]// /}" ]; do z=$((z + 1)); done
  while [ $z -lt ${#lines[@]} ] && [ -n "${lines[$z]// /}" ]; do text+=" ${lines[$z]}"; z=$((z + 1)); done
  echo "$text"
}

# ---- the environment a new user has: nothing of Open MPI's set, the programs not on PATH ----
for v in $(compgen -e | grep -E '^(OMPI_|PMIX_|DTK_)'); do unset "$v"; done
export HOME=$tmp
doc_bin "$HOME/.local/bin" "$build/tools"
doc_log=$tmp/log
mkdir -p "$doc_log"
gpu=0
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU' && gpu=1

# What differs between runs: measured values (numbers with a decimal point: times, bandwidths),
# clock times, host names, and Open MPI's process names ([[JOB,1],RANK]: whichever rank ended
# first) and count of the ranks that failed ("but 1 process returned\na non-zero exit code",
# or 2 processes ... exit codes).
mask() {
  sed -E 's/\[\[[0-9]+,[0-9]+\],[0-9]+\]/[[JOB]]/g; s/[0-9]+\.[0-9]+/X/g; s/[0-9]+:[0-9]+:X/TIME/g;
          s/(rank +[0-9]+:) [^ ]+/\1 HOST/; s/but [0-9]+ process(es)? returned/but N processes returned/;
          s/^(a )?non-zero exit codes?\./non-zero exit codes./; s/[[:space:]]+/ /g; s/^ //; s/ $//' "$1"
}
# The lines of $1 (expected) that are not, in order, among those of $2; nothing when all are.
missing_lines() {
  awk 'NR == FNR { if ($0 != "") want[++n] = $0; next }
       { if (k < n && $0 == want[k + 1]) k++ }
       END { for (i = k + 1; i <= n; i++) print want[i] }' <(mask "$1") <(mask "$2")
}

cur_sec=-1 ran=0 skipped=()
section_dir() {  # a fresh directory for section $1, entered
  [ "$1" = "$cur_sec" ] && return
  cur_sec=$1
  local d=$tmp/s$1
  mkdir -p "$d"
  ln -s "$build" "$d/build"; ln -s "$src/share" "$d/share"; ln -s "$src/scripts" "$d/scripts"
  cd "$d" || exit 1
}

# ---- run ----
for k in "${!b_line[@]}"; do
  line=${b_line[$k]} info=${b_info[$k]} body=${b_body[$k]} s=${b_sec[$k]}
  where="${b_file[$k]}:$line"
  read -r type rest <<<"$info"
  append="" reasons=""
  if [[ $rest == *append=* ]]; then append=${rest#*append=} reasons=${rest%%append=*}; else reasons=$rest; fi
  reasons=$(echo $reasons)
  case $type in
    text) continue ;;
    sh|console) ;;
    "") bad "$where: a code block without an info string (sh, sh REASON, console or text)" "${body%%$'\n'*}"; continue ;;
    *) bad "$where: unknown info string '$info'"; continue ;;
  esac
  skip=""
  for r in $reasons; do
    case $r in
      gpu) [ $gpu = 1 ] || skip+=" $r" ;;
      build|root|slurm|download|long) skip+=" $r" ;;
      exit=*) [ "$type" = console ] || bad "$where: exit= is for console blocks" ;;
      *) bad "$where: unknown reason '$r' (build, root, slurm, gpu, download, long)"; skip+=" $r" ;;
    esac
  done
  if [ -n "$skip" ]; then
    skipped+=("$where ($(echo $skip)): ${body%%$'\n'*}")
    continue
  fi
  if [ -n "$only" ] && ! grep -qE -- "$only" <<<"${sec_title[$s]}"; then  # its exports only
    while IFS= read -r l; do [[ $type == sh && $l == export\ * ]] && eval "$l"; done <<<"$body"
    continue
  fi
  if [ -n "$append" ]; then
    grep -qiF "the test appends \`$append\`" <<<"$(beside "${b_file[$k]}" "$line" "${b_end[$k]}")" \
      || bad "$where: append=$append, but the text beside the block does not say \"the test appends \`$append\`\""
  fi
  section_dir "$s"
  export DTK_DOC_APPEND=$append
  # Logical lines: a line ending in a backslash continues on the next.
  cmds=() cmd=""
  while IFS= read -r l; do
    cmd+=$l
    if [[ $cmd == *\\ ]]; then cmd+=$'\n'; continue; fi
    cmds+=("$cmd"); cmd=""
  done <<<"${body%$'\n'}"
  [ -z "$cmd" ] || cmds+=("$cmd")
  if [ "$type" = sh ]; then
    for c in "${cmds[@]}"; do
      [[ -z ${c// /} || $c =~ ^[[:space:]]*# ]] && continue
      doc_run "$where" "$c"; ran=$((ran + 1))
    done
  else
    want_rc=0
    [[ $reasons =~ exit=([0-9]+) ]] && want_rc=${BASH_REMATCH[1]}
    c="" expect=$tmp/expect
    : >"$expect"
    cmds+=('$ ')  # the end
    for l in "${cmds[@]}"; do
      if [[ $l == '$ '* ]]; then
        if [ -n "$c" ]; then
          t0=$SECONDS
          eval "$c" </dev/null >"$tmp/console" 2>&1
          rc=$?; ran=$((ran + 1))
          miss=$(missing_lines "$expect" "$tmp/console")
          if [ $rc = "$want_rc" ] && [ -z "$miss" ]; then ok "$where: \$ $c (exit $rc as shown, $((SECONDS - t0)) s)"
          else bad "$where: \$ $c (exit $rc, expected $want_rc)" "not printed as shown:" "$miss" "--- what it printed:" "$(tail -n 20 "$tmp/console")"; fi
        fi
        c=${l#\$ } ; : >"$expect"
      else
        printf '%s\n' "$l" >>"$expect"
      fi
    done
  fi
  unset DTK_DOC_APPEND
done

echo "skipped ${#skipped[@]} block(s):"
printf '  %s\n' "${skipped[@]}"
echo "ran $ran command(s) of README.md and docs/*.md in $((SECONDS - start)) s"
finish
