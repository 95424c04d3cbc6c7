#!/usr/bin/env bash
# shard-inspect export --format hf: a llama-tiny checkpoint from psgd-train as a Hugging Face
# LlamaForCausalLM folder. With plain python3: config.json, the HF names and shapes, the data of
# every tensor (q_proj and k_proj in transformers' rotary row order, checked against the dtk-named
# export of the same checkpoint), bf16, shards with their index, a sharded state as input, and bad
# input (exit 2, nothing written, an existing export untouched). Then, where the benchmark venv
# has transformers (bench/hf-check installs it; this test never does), transformers loads each
# folder strictly and its loss on random tokens equals that of bench/pytorch_llama.py's Llama
# (the PyTorch model dtk matches to 1e-7) holding the dtk-named export, within 1e-5.
# Exit 77 (skipped) when the plain checks pass and no venv with transformers exists.
#   export_hf.sh MPIEXEC PSGD_TRAIN FSDP_TRAIN SHARD_INSPECT SOURCE_DIR
set -uo pipefail
mpiexec=$1 psgd=$2 fsdp=$3 si=$4 src=$5
. "$(dirname "$0")/../common/check_lib.sh"
cd "$tmp" || exit 1
tiny="--model llama-tiny --steps 2 --global-batch 4 --eval-every 0 --log-level warn --metrics /dev/null"

run() { "$si" "$@" >"$tmp/o" 2>"$tmp/e"; rc=$?; }
$psgd $tiny --save ck.h5 >/dev/null 2>err || { bad "psgd-train llama-tiny" "$(cat err)"; finish; exit 1; }
run export ck.h5 model/ --format safetensors -o dtk.safetensors
run export ck.h5 --format hf -o hf32
[ $rc = 0 ] && [ "$(cat o)" = hf32 ] && ok "export --format hf" || bad "export --format hf (exit $rc)" "$(cat e)"

# check FOLDER DTK_EXPORT DTYPE MAX_SHARD (0: one file): the folder against the dtk-named export, independently of
# dtk's code (the names, the rotary row order and bf16's rounding written out here).
check=$(cat <<'PY'
import json, os, struct, sys
d, dtk, want_dtype, max_shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        assert n % 8 == 0
        return json.loads(f.read(n)), 8 + n
def values(path, h, off, name):
    b, e = h[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(off + b)
        raw = f.read(e - b)
    if h[name]["dtype"] == "BF16":
        return [struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in struct.unpack("<%dH" % (len(raw) // 2), raw)]
    return list(struct.unpack("<%df" % (len(raw) // 4), raw))
c = json.load(open(os.path.join(d, "config.json")))
assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama", c
assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (128, 4, 4, 2), c
assert c["vocab_size"] == 256 and c["intermediate_size"] == 384 and c["tie_word_embeddings"] is False, c
assert c["torch_dtype"] == {"F32": "float32", "BF16": "bfloat16"}[want_dtype], c
files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
where = {}
if max_shard == 0:  # unlimited: one file
    assert files == ["model.safetensors"], files
else:
    n = len(files)
    assert n > 1 and files == ["model-%05d-of-%05d.safetensors" % (i + 1, n) for i in range(n)], files
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    where = index["weight_map"]
hdrs = {}
for f in files:
    h, off = header(os.path.join(d, f))
    assert h.pop("__metadata__") == {"format": "pt"}
    for k in h:
        hdrs[k] = (os.path.join(d, f), h, off)
        assert not where or where[k] == f, (k, f)
    end = 0
    for k, t in sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        assert t["data_offsets"][0] == end and t["dtype"] == want_dtype, (k, t)
        end = t["data_offsets"][1]
    assert end == os.path.getsize(os.path.join(d, f)) - off, f
    assert max_shard == 0 or end <= max_shard or len(h) == 1, (f, end)  # a larger tensor alone
if where:
    size = sum(h[k]["data_offsets"][1] - h[k]["data_offsets"][0] for k, (_, h, _) in hdrs.items())
    assert set(where) == set(hdrs) and index["metadata"]["total_size"] == size
ours = {"model.embed_tokens.weight": "tok_embeddings", "model.norm.weight": "norm", "lm_head.weight": "output"}
for l in range(4):
    for a, b in (("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")):
        ours[f"model.layers.{l}.{a}.weight"] = f"layers.{l}.{b}"
    for a, b in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo")):
        ours[f"model.layers.{l}.self_attn.{a}.weight"] = f"layers.{l}.attention.{b}"
    for a, b in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
        ours[f"model.layers.{l}.mlp.{a}.weight"] = f"layers.{l}.feed_forward.{b}"
assert set(hdrs) == set(ours), sorted(set(hdrs) ^ set(ours))
hd, dh = header(dtk)
def bf16(v):  # to nearest even
    u = struct.unpack("<I", struct.pack("<f", v))[0]
    u = (u + 0x7fff + ((u >> 16) & 1)) >> 16
    return struct.unpack("<f", struct.pack("<I", u << 16))[0]
for name, (path, h, off) in hdrs.items():
    src = "model/" + ours[name] + ".weight"
    assert h[name]["shape"] == hd[src]["shape"], name
    got, want = values(path, h, off, name), values(dtk, hd, dh, src)
    if want_dtype == "BF16":
        want = [bf16(v) for v in want]
    heads = 4 if name.endswith("q_proj.weight") else 2 if name.endswith("k_proj.weight") else 0
    if heads:  # row h hd + 2i + c of dtk's is row h hd + c hd/2 + i of HF's
        rows, cols = h[name]["shape"]
        hdim = rows // heads
        perm = [0] * rows
        for hh in range(heads):
            for i in range(hdim // 2):
                for cc in range(2):
                    perm[hh * hdim + cc * hdim // 2 + i] = hh * hdim + 2 * i + cc
        want = [want[perm[r] * cols + k] for r in range(rows) for k in range(cols)]
    assert got == want, name
print(f"{len(hdrs)} tensors in {len(files)} file(s), {want_dtype}, HF names, q/k rows in rotary order")
PY
)
python3 -c "$check" hf32 dtk.safetensors F32 0 >out 2>err && ok "config, names, shapes and every value ($(cat out))" \
  || bad "the hf export's contents" "$(cat err)"
run export ck.h5 --format hf --dtype bf16 --max-shard-size 200K -o hf16
python3 -c "$check" hf16 dtk.safetensors BF16 204800 >out 2>err && ok "--dtype bf16 --max-shard-size 200K: $(cat out)" \
  || bad "bf16 sharded export" "$(cat e err)"
# A sharded state (fsdp-train on 2 ranks) exports the same model as its consolidation.
$mpiexec -n 2 $fsdp $tiny --param-dtype f32 --reduce-dtype f32 --save fs.ckpt >/dev/null 2>err || bad "fsdp-train" "$(cat err)"
run consolidate fs.ckpt -o fs.h5 && run export fs.h5 model/ --format safetensors -o fsdtk.safetensors \
  && run export fs.ckpt --format hf -o hfs
python3 -c "$check" hfs fsdtk.safetensors F32 0 >out 2>err && ok "a sharded state as input" || bad "sharded input" "$(cat e err)"

# ---- bad input: exit 2, nothing written, an existing export untouched ----
$psgd --model mlp-small --steps 1 --global-batch 4 --log-level warn --metrics /dev/null --save mlp.h5 >/dev/null 2>&1
expect2() {
  local what=$1 pattern=$2
  shift 2
  run "$@"
  [ $rc = 2 ] && [ "$(wc -l <e)" = 1 ] && grep -qi -- "$pattern" e && ok "$what: exit 2, one line" || bad "$what (exit $rc)" "$(cat e)"
}
expect2 "an mlp checkpoint" "llama" export mlp.h5 --format hf -o hfm
expect2 "a NAME with --format hf" "NAME" export ck.h5 model/ --format hf -o hfn
expect2 "an existing export without --force" "exists" export ck.h5 --format hf -o hf32
mkdir other && echo keep >other/file
expect2 "--force over a folder that is not an export" "not a Hugging Face export" export ck.h5 --format hf --force -o other
expect2 "--dtype f64" "dtype" export ck.h5 --format hf --dtype f64 -o hf64
[ ! -e hfm ] && [ ! -e hfn ] && [ ! -e hf64 ] && [ "$(cat other/file)" = keep ] && ! ls -A | grep -q tmp \
  && ok "nothing written, no temporaries, the other folder untouched" || bad "debris" "$(ls -A)"
cp -r hf16 hfr
run export ck.h5 --format hf --force -o hfr
[ $rc = 0 ] && [ -e hfr/model.safetensors ] && [ "$(ls hfr | wc -l)" = 2 ] && ! ls -A | grep -q tmp \
  && ok "--force replaces a previous export whole" || bad "--force over an export (exit $rc)" "$(cat e; ls hfr)"

# ---- transformers, where the benchmark venv has it ----
venv=${DTK_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dtk/torch-${DTK_TORCH_VERSION:-2.15.0}}
py=$venv/bin/python
if ! [ -x "$py" ] || ! "$py" -c "import torch, transformers, safetensors" 2>/dev/null; then
  finish || exit 1
  echo "skipped the transformers check: no venv with transformers at $venv (bench/hf-check makes one)"
  exit 77
fi
"$si" show --json ck.h5 | python3 -c 'import json, sys; json.dump(json.load(sys.stdin)["model_config"], sys.stdout)' >config.json
compare=$(cat <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, transformers
from safetensors.torch import load_file
from pytorch_llama import Llama
folder, dtk_export, bf16 = sys.argv[2], sys.argv[3], sys.argv[4] == "bf16"
hf, info = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
bad = {k: v for k, v in info.items() if v}
assert not bad, f"not a strict load: {bad}"
ref = Llama(json.load(open("config.json")))
sd = {k.removeprefix("model/"): v.float() for k, v in load_file(dtk_export).items()}
if bf16:  # the same bf16-rounded weights, computed in f32 on both sides
    sd = {k: v.to(torch.bfloat16).float() for k, v in sd.items()}
ref.load_state_dict(sd, strict=True)
tokens = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ours = ref(tokens[:, :-1], tokens[:, 1:]).item()
    logits = hf(input_ids=tokens[:, :-1]).logits
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
rel = abs(ours - theirs) / abs(ours)
print(f"transformers {transformers.__version__}: loss {theirs:.7f}, the reference {ours:.7f}, relative {rel:.1e}")
assert rel < 1e-5, rel
PY
)
for f in hf32:dtk:f32 hfs:fsdtk:f32 hf16:dtk:bf16; do
  IFS=: read -r folder export dtype <<<"$f"
  "$py" -c "$compare" "$src/bench" "$folder" "$export.safetensors" "$dtype" >out 2>err \
    && ok "$folder: transformers loads it strictly; $(cat out)" || bad "transformers on $folder" "$(tail -5 err)"
done
finish
