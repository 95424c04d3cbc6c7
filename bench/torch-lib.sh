# Sourced by the benchmarks against PyTorch (bench-vs-pytorch, bench-fsdp): what both sides need
# of one llama. Needs $py (bench/torch-venv's python), $tmp, and the built $psgd, $inspect
# (shard-inspect) and $pack (data-pack).
#
# torch_prepare NAME WINDOWS MODEL_ARGS...: under $tmp/NAME.*: dtk's model config (.config, from a
# checkpoint of one step, .ckpt.h5), its weights for PyTorch (.npz), WINDOWS windows of the
# synthetic language (.tokens.h5 for dtk, .tokens.bin raw for PyTorch, .dtype), and the model
# check (.check.dtk, .check.torch): the loss of the checkpoint's weights on the same 4 sequences,
# computed by each side. Done once per NAME.
torch_prepare() {
  local name=$1 windows=$2 p=$tmp/$1 vocab seq
  shift 2
  [ -f "$p.config" ] && return
  echo "$(basename "$0"): preparing $name ($*)" >&2
  "$psgd" "$@" --steps 1 --global-batch 1 --compressor none --optimizer sgd --momentum 0 --eval-batches 1 \
    --log-level warn --metrics /dev/null --save "$p.ckpt.h5" >/dev/null
  "$inspect" export "$p.ckpt.h5" --format npz -o "$p.npz" >/dev/null
  "$inspect" show --json "$p.ckpt.h5" |
    "$py" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["model_config"]))' >"$p.config"
  read -r vocab seq < <("$py" -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c["vocab"], c["seq_len"])' "$p.config")
  for f in tokens:"$windows" check:4; do
    "$pack" synthetic --kind tokens --vocab "$vocab" --seq-len "$seq" --samples "${f#*:}" --seed 0 \
      --log-level warn -o "$p.${f%:*}.h5" >/dev/null
    h5dump -d /tokens -b LE -o "$p.${f%:*}.bin" "$p.${f%:*}.h5" >/dev/null
  done
  case $(h5dump -H -d /tokens "$p.tokens.h5") in *U16LE*) echo uint16 ;; *) echo uint32 ;; esac >"$p.dtype"
  "$psgd" "$@" --init-from "$p.ckpt.h5" --data "$p.check.h5" --global-batch 4 --steps 1 --log-level warn \
    --metrics "$p.check.dtk" >/dev/null
  "$py" bench/pytorch_llama.py --model-config "$(cat "$p.config")" --init-from "$p.npz" --tokens "$p.check.bin" \
    --tokens-dtype "$(cat "$p.dtype")" --global-batch 4 --steps 1 --metrics "$p.check.torch"
}

# torch_free_port: a TCP port free now (PyTorch's rendezvous, MASTER_PORT).
torch_free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# torch_args NAME: pytorch_llama.py's arguments for that llama and its token stream (paths
# without spaces: $tmp's).
torch_args() { echo --model-config "$tmp/$1.config" --tokens "$tmp/$1.tokens.bin" --tokens-dtype "$(cat "$tmp/$1.dtype")"; }

# torch_rss_run N OUT COMMAND...: COMMAND on N ranks (mpiexec, loopback; PyTorch's rendezvous
# set), stdout dropped; each rank's peak resident memory (bytes) in OUT.RANK.
torch_rss_run() {
  local n=$1 out=$2
  shift 2
  rm -f "$out".*
  mpiexec -n "$n" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$(torch_free_port)" -x GLOO_SOCKET_IFNAME=lo python3 -c '
import os, resource, subprocess, sys
code = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL).returncode
with open(sys.argv[1] + "." + os.environ.get("OMPI_COMM_WORLD_RANK", "0"), "w") as f:
    f.write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}\n")
sys.exit(code)' "$out" "$@"
}
# torch_max_rss OUT: the largest over the ranks of torch_rss_run's OUT.
torch_max_rss() { cat "$1".* | sort -n | tail -1; }
