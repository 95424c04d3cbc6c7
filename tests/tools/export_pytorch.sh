#!/usr/bin/env bash
# shard-inspect export of the model alone, loaded into PyTorch as shard-inspect(1)'s EXAMPLES say
# (issue 30): a llama-tiny checkpoint from psgd-train, exported with the man page's commands; with
# plain python3, the files hold the model's tensors and no optimizer state; then, with PyTorch
# (bench/torch-venv's environment, never installed by this test), the man page's loading
# snippets into bench/pytorch_llama.py's Llama with load_state_dict(strict=True).
# Exit 77 (skipped) when the plain checks pass but no PyTorch environment with numpy or
# safetensors exists: $DTK_TORCH_VENV, else ~/.cache/dtk/torch-$DTK_TORCH_VERSION (2.15.0).
#   export_pytorch.sh PSGD_TRAIN SHARD_INSPECT SOURCE_DIR
set -uo pipefail
psgd=$1 si=$2 src=$3
. "$(dirname "$0")/../common/check_lib.sh"
cd "$tmp" || exit 1
man=$src/man/man1/shard-inspect.1

# block TAG: the .EX block after the man page's `.\" test: export_pytorch TAG` line, unescaped.
block() {
  awk -v tag="$1" '
    $0 == ".\\\" test: export_pytorch " tag { found = 1; next }
    found && $0 == ".EX" { inside = 1; next }
    inside && $0 == ".EE" { exit }
    inside { print }' "$man" | sed -e 's/\\-/-/g' -e "s/\\\\(aq/'/g" -e 's/\\e/\\/g' -e 's/\\&//g'
}

# ---- a llama-tiny checkpoint with optimizer (AdamW) and compressor (PowerSGD) state ----
mkdir -p ckpt
if "$psgd" --model llama-tiny --steps 1 --global-batch 2 --eval-batches 1 --log-level warn --metrics /dev/null \
     --save ckpt/step-00001000.h5 >/dev/null 2>err; then
  ok "psgd-train llama-tiny: a checkpoint"
else
  bad "psgd-train llama-tiny" "$(cat err)"; finish; exit
fi
"$si" show --json ckpt/step-00001000.h5 | python3 -c 'import json, sys; json.dump(json.load(sys.stdin)["model_config"], sys.stdout)' >config.json
"$si" ls --json ckpt/step-00001000.h5 >ls.json

# ---- the man page's commands, as written (the checkpoint is a file here) ----
block shell >export.sh
grep -q 'export ckpt/step-00001000 model/ --format safetensors' export.sh && grep -q -- '--format npz' export.sh \
  && ok "the man page's export commands found" || bad "no export commands in $man" "$(cat export.sh)"
sed -i 's|ckpt/step-00001000 |ckpt/step-00001000.h5 |' export.sh
if PATH=$(dirname "$si"):$PATH bash -e export.sh >out 2>err; then
  ok "the man page's export commands ran"
else
  bad "the man page's export commands" "$(cat export.sh err)"
fi
"$si" export ckpt/step-00001000.h5 --format npz -o full.npz >/dev/null 2>err || bad "export of everything" "$(cat err)"

# ---- plain python3: the names in the files ----
names_check=$(cat <<'EOF'
import json, struct, sys, zipfile
def names(path):
    if path.endswith(".npz"):
        return sorted(n.removesuffix(".npy") for n in zipfile.ZipFile(path).namelist())
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")
model = sorted(t["name"] for t in json.load(open("ls.json"))["tensors"] if t["name"].startswith("model/"))
for path in sys.argv[1:]:
    got = names(path)
    others = [n for n in got if not n.startswith("model/")]
    assert not others, f"{path}: not the model's: {others[:5]}"
    assert got == model, f"{path}: {len(got)} tensors, the checkpoint's model has {len(model)}"
    print(f"{path}: {len(got)} tensors, all model/, no optim/")
full = names("full.npz")
assert any(n.startswith("optim/") for n in full), "the export of everything has no optim/ tensor"
EOF
)
if python3 -c "$names_check" model.safetensors model.npz >out 2>err; then
  ok "model/ alone: the model's tensors, no optim/ ($(tr '\n' ' ' <out))"
else
  bad "names of the model-only exports" "$(cat err)"
fi

# ---- a NAME that selects nothing: exit 2, nothing written ----
"$si" export ckpt/step-00001000.h5 nosuch/ --format npz -o none.npz >/dev/null 2>err
rc=$?
[ $rc = 2 ] && [ ! -e none.npz ] && ok "export NAME selecting nothing: exit 2, nothing written" \
  || bad "export nosuch/: exit $rc" "$(cat err)"

# ---- PyTorch: the man page's loading snippets, strict ----
venv=${DTK_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dtk/torch-${DTK_TORCH_VERSION:-2.15.0}}
py=$venv/bin/python
ran=0
# load SNIPPET FILE: runs the snippet with `model` a Llama of the checkpoint's config and FILE for
# the snippet's model.* name; prints the exception, on one line, when the load fails.
loader=$(cat <<'EOF'
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from pytorch_llama import Llama
snippet, path = open(sys.argv[2]).read(), sys.argv[3]
snippet = snippet.replace('"model.safetensors"', json.dumps(path)).replace('"model.npz"', json.dumps(path))
model = Llama(json.load(open("config.json")))
g = {"model": model}
try:
    exec(snippet, g)
except Exception as e:
    print(" ".join(str(e).split())[:300]); sys.exit(1)
sd = g["sd"]
state = model.state_dict()
assert all(torch.equal(state[k], v.to(state[k].dtype)) for k, v in sd.items()), "values differ after the load"
print(f"{len(sd)} tensors loaded")
EOF
)
for fmt in npz safetensors; do
  mod=numpy
  [ $fmt = safetensors ] && mod=safetensors
  if ! [ -x "$py" ] || ! "$py" -c "import torch, $mod" 2>/dev/null; then
    echo "skip the $fmt snippet: no PyTorch with $mod at $venv"
    continue
  fi
  ran=1
  block $fmt >load_$fmt.py
  if "$py" -c "$loader" "$src/bench" load_$fmt.py model.$fmt >out 2>err; then
    ok "PyTorch $("$py" -c 'import torch; print(torch.__version__)'): the man page's $fmt snippet, strict: $(cat out)"
  else
    bad "the man page's $fmt snippet" "$(cat load_$fmt.py out err)"
  fi
  if [ $fmt = npz ]; then  # what model/ is for: everything exported, the strict load refuses the rest
    if "$py" -c "$loader" "$src/bench" load_npz.py full.npz >out 2>err; then
      bad "the export of everything loaded strictly" "$(cat out)"
    else
      grep -q 'Unexpected key(s) in state_dict: "\(optim\|compress\)/' out \
        && ok "... and the export of everything fails it: $(cut -c1-90 out)..." \
        || bad "the export of everything: not refused for its optimizer and compressor state" "$(cat out err)"
    fi
  fi
done
finish || exit 1
[ $ran = 1 ] || { echo "skipped: no PyTorch environment at $venv"; exit 77; }
