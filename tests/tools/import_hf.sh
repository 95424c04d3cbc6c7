#!/usr/bin/env bash
# --init-from a Hugging Face Llama folder. With plain python3: dtk -> HF -> dtk is bit-identical
# in f32 (psgd-train, and fsdp-train on 2 ranks reading only their rows), a bf16 export in shards
# comes back as its bf16 values, --model and the size options may restate the config but not
# contradict it, and bad folders (a truncated file, an index naming a missing shard, a header
# that lies about offsets, a missing tensor, a shape that does not fit, another architecture,
# RoPE scaling, --resume of a folder) are one line and exit 2 on every rank, nothing written.
# Then, where the benchmark venv has transformers (bench/hf-check installs it; this test never
# does), transformers makes tiny random Llamas (f32, bf16 in shards, f16 with tied embeddings)
# and dtk's loss at step 1 from --init-from equals transformers' on the same tokens within 1e-5.
# Exit 77 (skipped) when the plain checks pass and no venv with transformers exists.
#   import_hf.sh MPIEXEC PSGD_TRAIN FSDP_TRAIN SHARD_INSPECT DATA_PACK
set -uo pipefail
mpiexec=$1 psgd=$2 fsdp=$3 si=$4 dp=$5
. "$(dirname "$0")/../common/check_lib.sh"
cd "$tmp" || exit 1
quiet="--eval-every 0 --log-level warn --metrics /dev/null"
# lr 1e-30: AdamW's first step moves no f32 weight (every update is far below half an ulp), so the
# step's checkpoint holds the weights as imported.
still="--steps 1 --global-batch 4 --lr 1e-30 $quiet"

$psgd --model llama-tiny --steps 2 --global-batch 4 $quiet --save ck.h5 >/dev/null 2>err || bad "psgd-train" "$(cat err)"
"$si" export ck.h5 --format hf -o hf32 >/dev/null 2>err || bad "export" "$(cat err)"
"$si" export ck.h5 --format hf --dtype bf16 --max-shard-size 200K -o hf16 >/dev/null 2>err || bad "export bf16" "$(cat err)"
"$si" export ck.h5 model/ --format safetensors -o dtk.safetensors >/dev/null 2>err || bad "export" "$(cat err)"

same_model() {  # A B [--rtol R]: every model tensor of A within the tolerance of B's
  local a=$1 b=$2
  shift 2
  "$si" diff "$a" "$b" model/ "$@" >d 2>&1 && grep -q "39 tensors compared, 0 different" d
}
$psgd --init-from hf32 $still --save p.h5 >/dev/null 2>err && same_model ck.h5 p.h5 \
  && ok "psgd-train: dtk -> HF -> dtk is bit-identical" || bad "psgd-train's import" "$(cat err d)"
$mpiexec -n 2 $fsdp --init-from hf32 $still --param-dtype f32 --reduce-dtype f32 --save f.ckpt >/dev/null 2>err \
  && same_model ck.h5 f.ckpt && ok "fsdp-train on 2 ranks: bit-identical (each rank reads its rows)" \
  || bad "fsdp-train's import" "$(cat err d)"
$psgd --init-from hf16 --model llama-tiny --seq-len 32 $still --save b.h5 >/dev/null 2>err \
  && same_model ck.h5 b.h5 --rtol 0.00390625 && ! same_model ck.h5 b.h5 \
  && ok "a bf16 export in shards (an index): the bf16 values, --model and --seq-len restating it" \
  || bad "bf16 import" "$(cat err d)"

# ---- bad input: one line, exit 2 on every rank, nothing written ----
# edit FOLDER PYTHON: a copy of hf32 as FOLDER, then PYTHON run in it (h: header, data: bytes, save()).
edit() {
  local folder=$1 code=$2
  rm -rf "$folder" && cp -r hf32 "$folder" && (cd "$folder" && python3 -c "
import json, struct
raw = open('model.safetensors', 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
h, data = json.loads(raw[8:8 + n]), raw[8 + n:]
def save(h, data):
    j = json.dumps(h).encode()
    open('model.safetensors', 'wb').write(struct.pack('<Q', len(j)) + j + data)
def config(**kw):
    c = json.load(open('config.json'))
    c.update(kw)
    json.dump(c, open('config.json', 'w'))
$code")
}
expect2() {  # WHAT PATTERN RANKS FOLDER [OPTIONS]
  local what=$1 pattern=$2 n=$3 folder=$4
  shift 4
  local prog=$psgd
  [ "$n" -gt 1 ] && prog="$mpiexec -n $n $fsdp"
  rm -f out.h5
  $prog --init-from "$folder" $still "$@" --save out.h5 --log-all-ranks >/dev/null 2>e
  local rc=$?
  # The ranks' lines, less their prefixes, are one line; the launcher aborted nothing.
  grep ' error: ' e | sed 's/.* error: //' | sort -u >said
  [ $rc = 2 ] && [ "$(wc -l <said)" = 1 ] && [ "$(grep -c ' error: ' e)" -le "$n" ] && grep -qi -- "$pattern" said \
    && ! grep -qE "MPI_ABORT|exited on signal|[Kk]illed" e && [ ! -e out.h5 ] && ! ls -A | grep -q tmp \
    && ok "$what ($n rank(s)): exit 2, one line: $(cut -c1-140 said)" || bad "$what (exit $rc)" "$(cat e)"
}
edit trunc "open('model.safetensors', 'ab').truncate(len(raw) - 100)"
expect2 "a truncated safetensors file" "truncated" 2 trunc
edit lies "h['model.norm.weight']['data_offsets'][1] += 4; save(h, data)"
expect2 "a header whose offsets do not fit the shape" "data_offsets" 1 lies
edit overlap "
k = sorted((v['data_offsets'][0], n) for n, v in h.items() if n != '__metadata__')
a, b = h[k[0][1]], h[k[1][1]]
size = b['data_offsets'][1] - b['data_offsets'][0]
b['data_offsets'] = [a['data_offsets'][0], a['data_offsets'][0] + size]
save(h, data)"
expect2 "a header that lies about offsets (two tensors overlap)" "overlap" 2 overlap
edit notjson "open('model.safetensors', 'wb').write(struct.pack('<Q', 8) + b'{notjson' + data)"
expect2 "a header that is not JSON" "JSON" 1 notjson
edit missing "del h['model.layers.1.mlp.up_proj.weight']; save(h, data)"
expect2 "a missing tensor" "up_proj" 2 missing
edit shape "config(intermediate_size=192)"
expect2 "a config whose sizes the tensors do not have" "gate_proj" 1 shape
edit mistral "config(model_type='mistral', architectures=['MistralForCausalLM'])"
expect2 "another architecture" "mistral" 2 mistral
edit scaled "config(rope_scaling={'rope_type': 'llama3', 'factor': 8.0})"
expect2 "RoPE scaling" "llama3" 1 scaled
edit biased "config(attention_bias=True)"
expect2 "attention biases" "bias" 1 biased
rm -rf noshard && cp -r hf16 noshard && rm noshard/model-00002-of-*.safetensors
expect2 "an index naming a missing shard" "missing" 2 noshard
expect2 "--model contradicting the config" "contradicts" 1 hf32 --model llama-small
expect2 "--dim contradicting the config" "contradicts" 2 hf32 --dim 64
rm -f out.h5
$psgd --resume hf32 $still --save out.h5 >/dev/null 2>e
[ $? = 2 ] && grep -q "init-from" e && [ ! -e out.h5 ] && ok "--resume of a folder: exit 2, points to --init-from" \
  || bad "--resume hf" "$(cat e)"

# ---- transformers, where the benchmark venv has it ----
venv=${DTK_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dtk/torch-${DTK_TORCH_VERSION:-2.15.0}}
py=$venv/bin/python
if ! [ -x "$py" ] || ! "$py" -c "import torch, transformers, safetensors" 2>/dev/null; then
  finish || exit 1
  echo "skipped the transformers check: no venv with transformers at $venv (bench/hf-check makes one)"
  exit 77
fi
# 4 windows of 33 tokens: a global batch of 4 is the whole file, so step 1's loss is over every window.
python3 -c "
import random; random.seed(1); print(''.join(chr(random.randrange(32, 127)) for _ in range(4 * 32 + 1)), end='')" >t.txt
"$dp" text t.txt -o tok.h5 --log-level warn >/dev/null 2>err || bad "data-pack" "$(cat err)"
make=$(cat <<'PY'
import sys, torch, transformers
out, dtype, tie, shard = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
torch.manual_seed(0)
c = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, rope_theta=50000.0,
                             rms_norm_eps=1e-5, tie_word_embeddings=tie)
m = transformers.LlamaForCausalLM(c)
with torch.no_grad():  # norm weights away from 1, so that loading them matters
    for n, p in m.named_parameters():
        if "norm" in n:
            p.uniform_(0.5, 1.5)
m.to({"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]).save_pretrained(out, max_shard_size=shard)
# the loss on the file's 4 windows, in f32
text = torch.tensor(list(open("t.txt", "rb").read()))
x = torch.stack([text[i * 32:i * 32 + 33] for i in range(4)])
m = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
with torch.no_grad():
    logits = m(input_ids=x[:, :-1]).logits
print(repr(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item()))
PY
)
for v in "f32 0 5GB 1" "bf16 0 50KB 2" "f16 1 5GB 2"; do
  read -r dtype tie shard ranks <<<"$v"
  rm -rf hfm m.jsonl
  theirs=$("$py" -c "$make" hfm "$dtype" "$tie" "$shard" 2>err) || { bad "transformers ($v)" "$(tail -5 err)"; continue; }
  prog=$psgd
  [ "$ranks" -gt 1 ] && prog="$mpiexec -n $ranks $fsdp --param-dtype f32 --reduce-dtype f32"
  $prog --init-from hfm --data tok.h5 --global-batch 4 --steps 1 --eval-every 0 --log-level warn --metrics m.jsonl \
    >/dev/null 2>err || { bad "dtk on transformers' $v" "$(cat err)"; continue; }
  ours=$(python3 -c "import json; print(json.loads(open('m.jsonl').readline())['loss'])")
  what="transformers $("$py" -c 'import transformers; print(transformers.__version__)') $dtype"
  [ "$tie" = 1 ] && what+=" tied"
  [ "$shard" != 5GB ] && what+=" in $(ls hfm/*.safetensors | wc -l) shards"
  python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(abs(a - b) > 1e-5 * abs(b))" \
    "$ours" "$theirs" && ok "$what, $ranks rank(s): dtk's loss $ours, transformers' $theirs" \
    || bad "$what: dtk's loss $ours, transformers' $theirs" ""
done
finish
