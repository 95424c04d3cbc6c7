# Sourced by the tests that run documented commands as written (readme.sh: README.md's examples;
# configs.sh: the launch lines at the head of share/dtk/configs/*.toml). Needs check_lib.sh's ok/bad
# and programs.
#
# doc_bin DIR TOOLS: DIR gets every program by name (the list in TOOLS/../programs.txt), as
# `cmake --install` puts them in PREFIX/bin: each linked from TOOLS/<program>/<program>, except
# the trainers and comm-bench, which become scripts that run the build's program with
# $DTK_DOC_APPEND after the command line's own arguments (a repeated option takes its last
# value), so that a test can shorten a documented run without changing its text.
doc_bin() {
  local dir=$1 tools=$2 p list
  mkdir -p "$dir"
  list=$(programs "$tools/..") || return 1
  for p in $list; do
    case $p in
      psgd-train|shampoo-train|fsdp-train|comm-bench)
        printf '#!/bin/sh\n# %s with the options a documentation test appends ($DTK_DOC_APPEND)\nexec %q "$@" $DTK_DOC_APPEND\n' \
          "$p" "$tools/$p/$p" >"$dir/$p"
        chmod +x "$dir/$p" ;;
      *) ln -sf "$tools/$p/$p" "$dir/$p" ;;
    esac
  done
}

# doc_check CMD OUT: what is wrong with the output of command CMD that exited 0 (its stdout in OUT),
# on stdout; nothing when it looks right:
#   - a pipeline into jq printed something, and no value null or false (a line of its own);
#   - a pipeline into xargs printed something (with -r, an empty input runs nothing and exits 0);
#   - `> FILE` wrote FILE, not empty; FILE.json is JSON;
#   - the outputs named by -o, --save, --val-output exist; a --metrics FILE has a numeric loss;
#   - a trainer with its metrics on stdout printed a line with a numeric loss;
#   - comm-bench's table ends with `# wrong elements: 0`.
doc_check() {
  local cmd=${1//$'\\\n'/ } out=$2 w prev="" metrics="" trainer=0 bench=0 redirected=0 f
  local -a words
  read -ra words <<<"${cmd%%#*}"
  [[ $cmd =~ \|[[:space:]]*jq ]] && redirected=1 && { [ -s "$out" ] && ! grep -qE '^[[:space:]]*(null|false),?[[:space:]]*$' "$out" || echo "jq printed nothing, null or false"; }
  [[ $cmd =~ \|[[:space:]]*xargs ]] && redirected=1 && { [ -s "$out" ] || echo "nothing came out of the xargs pipeline"; }
  [[ $cmd =~ \|[[:space:]]*(grep|head|tail|sort) ]] && redirected=1
  for w in "${words[@]}"; do
    case $prev in
      -o|--save|--val-output) [ -e "$w" ] || echo "no $w written" ;;
      --metrics) metrics=$w ;;
      '>') redirected=1
           if [ "$w" != /dev/null ]; then
             [ -s "$w" ] || echo "$w is empty"
             [[ $w != *.json ]] || jq -e . "$w" >/dev/null 2>&1 || echo "$w is not JSON"
           fi ;;
    esac
    case $w in
      psgd-train|shampoo-train|fsdp-train|*/psgd-train|*/shampoo-train|*/fsdp-train) trainer=1 ;;
      comm-bench|*/comm-bench) bench=1 ;;
      --print-plan|--help|--version|--json) trainer=0 bench=0 ;;
      '>'*) redirected=1 ;;
    esac
    prev=$w
  done
  if [ $trainer = 1 ]; then
    if [ -n "$metrics" ] && [ "$metrics" != - ]; then f=$metrics; else f=$out; fi
    [ "$f" = "$out" ] && [ $redirected = 1 ] && return
    grep '^{' "$f" 2>/dev/null | jq -e -s 'map(select(.loss | type == "number")) | length > 0' >/dev/null 2>&1 \
      || echo "no metrics with a numeric loss in ${metrics:-its stdout}"
  fi
  if [ $bench = 1 ] && [ $redirected = 0 ]; then
    grep -q '^# wrong elements: 0$' "$out" || echo "comm-bench printed no '# wrong elements: 0'"
  fi
}

# doc_run WHERE CMD: runs CMD as written (eval, in this shell: an assignment or export stays for
# the next command; stdin /dev/null, set -o pipefail), stdout in $doc_log/N.out, stderr in
# $doc_log/N.err; ok when it exits 0 and doc_check finds nothing, else bad with the reason and
# the end of its stderr. $doc_rc: its exit status.
doc_n=0
doc_run() {
  local where=$1 cmd=$2 problems t0=$SECONDS
  doc_n=$((doc_n + 1))
  local out=$doc_log/$doc_n.out err=$doc_log/$doc_n.err
  eval "$cmd" </dev/null >"$out" 2>"$err"
  doc_rc=$?
  local first=${cmd%%$'\n'*}
  if [ $doc_rc != 0 ]; then
    bad "$where: $first (exit $doc_rc)" "$(tail -n 15 "$err")"
  elif problems=$(doc_check "$cmd" "$out") && [ -n "$problems" ]; then
    bad "$where: $first ($problems)" "$(tail -n 8 "$err")"
  else
    ok "$where: $first ($((SECONDS - t0)) s)"
  fi
}
