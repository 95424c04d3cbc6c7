#!/usr/bin/env bash
# docs/DESIGN.md's map, "Where things happen", checked against the code: every `FILE:SYMBOL` it
# names must be a file of the repository that defines SYMBOL (its last name as a function, a
# variable, a class or a struct; each qualifier as a class, a struct, a namespace or `Q::` in the
# file), so that a rename or a move fails here until the map follows it. Then the check itself is
# checked: a renamed symbol and a moved file must fail.
# Usage: symbols.sh SOURCE_DIR
set -uo pipefail
src=$(realpath "$1")
. "$(dirname "$0")/../common/check_lib.sh"

# Why FILE:SYMBOL is not found, or nothing when it is.
missing() {
  local file=${1%%:*} sym=${1#*:} name q
  [ -f "$src/$file" ] || { echo "no file $file"; return; }
  name=${sym##*::}
  grep -qE "(\\b$name\\b[[:space:]]*[([{:=<])|((class|struct)[[:space:]]+$name\\b)" "$src/$file" \
    || { echo "$file defines no $name"; return; }
  if [[ $sym == *::* ]]; then
    IFS=: read -ra quals <<<"${sym%::*}"
    for q in "${quals[@]}"; do
      [ -z "$q" ] && continue
      grep -qE "((class|struct|namespace)[[:space:]]+$q\\b)|(\\b$q::)" "$src/$file" || { echo "$file has no $q"; return; }
    done
  fi
}

map=$(awk '/^## Where things happen/ { on = 1; next } /^## / { on = 0 } on' "$src/docs/DESIGN.md" \
      | grep -oE '`[a-z][A-Za-z0-9_./-]*:[A-Za-z_][A-Za-z0-9_:~]*`' | tr -d '`')
n=$(echo "$map" | grep -c .)
[ "$n" -ge 20 ] || bad "docs/DESIGN.md's map names $n symbols (expected its table of 20 or more)"
for e in $map; do
  why=$(missing "$e")
  if [ -z "$why" ]; then ok "$e"; else bad "docs/DESIGN.md names $e: $why"; fi
done

# The check fails on a rename and on a move.
[ -n "$(missing lib/dtk/train/trainer.cpp:Trainer::train_step_renamed)" ] && ok "a renamed symbol is caught" || bad "a renamed symbol passes"
[ -n "$(missing lib/dtk/train/trainer.cpp:Renamed::train_step)" ] && ok "a renamed class is caught" || bad "a renamed class passes"
[ -n "$(missing lib/dtk/train/moved.cpp:Trainer::train_step)" ] && ok "a moved file is caught" || bad "a moved file passes"
finish
