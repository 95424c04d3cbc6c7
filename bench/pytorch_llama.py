#!/usr/bin/env python3
"""The llama of docs/DESIGN.md ("Models") in PyTorch, trained as psgd-train trains it: the baseline
of bench/bench-vs-pytorch. Not part of dtk (dtk does not depend on torch).

One process trains alone; under mpiexec (OMPI_COMM_WORLD_RANK/SIZE, MASTER_ADDR/MASTER_PORT) the
processes form a gloo group and train with DistributedDataParallel (25 MiB buckets), optionally
with the PowerSGD comm hook, or with --fsdp fully sharded by FSDP2 (fully_shard per block and
over the rest, parameters resharded after forward), the baseline of bench/bench-fsdp. The options carry psgd-train's names and defaults (AdamW, clipping
by global norm, the cosine schedule of lib/dtk/optim), and the metrics are psgd-train's JSON lines
(step, loss, lr, grad_norm, tokens_per_s, step_time_ms), so the two read alike.

  python3 bench/pytorch_llama.py --model-config '{"dim": 128, ...}' --tokens TOKENS.bin \\
      --global-batch 16 --steps 30 --threads 2

--model-config is the model_config of a dtk checkpoint (shard-inspect show --json). --tokens is a
raw little-endian token stream (h5dump -b of a data-pack token file); sample k is the window of
seq_len + 1 tokens at k * seq_len, as dtk reads token files, and step s takes samples
s * global_batch .. (s + 1) * global_batch - 1 (wrapping around), each rank its contiguous share.

On a GPU (--device cuda, one process; scripts/gpu-check's perf-llama3-1b), --dtype bf16 trains as
PyTorch users train today: f32 master weights, forward and loss under torch.autocast(bfloat16),
attention by scaled_dot_product_attention(is_causal=True) (the flash kernel in bf16; the stderr
line says whether it applies to the model's shapes), AdamW with fused=True. --dtype f32 keeps
every product in f32 (SDPA then falls back to its math kernel for grouped-query attention). The
metrics add model_flops_per_s (PaLM's accounting, dtk's ModelConfig::train_flops_per_item: 6 x the
matmul weights of the layers and the output head + 12 x layers x dim x seq_len, per token), and
on the GPU peak_mem_bytes and persistent_mem_bytes as psgd-train reports them: the largest bytes
of live tensors during the step (torch.cuda.max_memory_allocated after reset_peak_memory_stats at
its start), and those allocated when it began. On the CPU (the default) nothing else changes.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------ the model

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len, head_dim, theta):
    """cos and sin [seq_len, head_dim / 2] of the angles pos * theta^(-2i / head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Rotates the pairs (2i, 2i + 1) of each head of x [batch, seq, heads, head_dim]. The rotation
    is computed in f32 (cos and sin are f32) and given back in x's dtype, as Meta's code does: bf16
    under autocast, so that q, k and v reach attention in one dtype (f32: unchanged)."""
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_heads, self.n_kv_heads = c["n_heads"], c["n_kv_heads"]
        self.head_dim = c["dim"] // self.n_heads
        self.wq = nn.Linear(c["dim"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c["dim"], self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, c["dim"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, t, head_dim]
        # causal attention as a PyTorch user writes it today: scaled_dot_product_attention, its
        # grouped-query form (query head h reads key/value head h / (n_heads / n_kv_heads))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.w1 = nn.Linear(c["dim"], c["ffn_hidden"], bias=False)
        self.w2 = nn.Linear(c["ffn_hidden"], c["dim"], bias=False)
        self.w3 = nn.Linear(c["dim"], c["ffn_hidden"], bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])
        self.feed_forward = FeedForward(c)

    def forward(self, h, cos, sin):
        h = h + self.attention(self.attention_norm(h), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Parameter names and shapes as dtk's (Meta's): tok_embeddings, layers.i.*, norm, output."""

    def __init__(self, c):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c["vocab"], c["dim"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["n_layers"]))
        self.norm = RMSNorm(c["dim"], c["norm_eps"])
        self.output = nn.Linear(c["dim"], c["vocab"], bias=False)
        # constants, not buffers (as in Meta's code): DDP has nothing to broadcast each step
        self.cos, self.sin = rope_tables(c["seq_len"], c["dim"] // c["n_heads"], c["rope_theta"])
        # dtk's initialisation: N(0, 0.02), the residual projections scaled by 1 / sqrt(2 layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 0.02
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                std /= math.sqrt(2 * c["n_layers"])
            nn.init.normal_(p, 0.0, std)

    checkpointing = False  # recompute each block's forward in backward (torch.utils.checkpoint)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.checkpointing:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---------------------------------------------------------------------------------- training

def one_bucket_at_a_time(hook):
    """The DDP comm hook `hook`, its buckets run one after the other within a step.

    torch 1.13's powerSGD_hook issues a bucket's P and Q all-reduces from completion callbacks,
    so with several buckets in flight the ranks can issue collectives in different orders; gloo
    then pairs messages of different collectives and aborts ("enforce fail at pair.cc: op.preamble.
    length <= op.nbytes"). Starting bucket k + 1's hook when bucket k's future completes gives every
    rank the same order (DDP hands the buckets over in index order on every rank). Kept with
    current torch; whether its hook still needs it was not tested."""
    previous = [None]

    def run(state, bucket):
        if previous[0] is None:
            fut = hook(state, bucket)
        else:
            fut = torch.futures.Future()

            def finish(f):
                try:
                    fut.set_result(f.value())
                except Exception as e:  # handed to DDP, which raises it in backward
                    fut.set_exception(e)

            def start(_):
                try:
                    hook(state, bucket).then(finish)
                except Exception as e:
                    fut.set_exception(e)
            previous[0].then(start)
        previous[0] = None if bucket.is_last() else fut
        return fut
    return run


def lr_at(step, a):
    """lib/dtk/optim Schedule::at: linear warm-up, then constant, linear or cosine decay to
    min_lr_ratio * lr at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.schedule == "constant":
        return a.lr
    span = a.steps - a.warmup
    q = 1.0 if span <= 0 else min(1.0, (step - a.warmup) / span)
    if a.schedule == "linear":
        return a.lr * (1.0 - (1.0 - a.min_lr_ratio) * q)
    return a.lr * (a.min_lr_ratio + (1.0 - a.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * q)))


def train_flops_per_token(c):
    """dtk's ModelConfig::train_flops_per_item for a llama (PaLM's MFU accounting): 6 x (every
    linear of the layers + the output head; not the embedding or the norms) + the two T x T
    products of attention per layer, 2 x 2 x seq_len x dim forward, times 3 for forward and
    backward (no causal discount)."""
    d, hd = c["dim"], c["dim"] // c["n_heads"]
    per_layer = 2 * d * c["n_heads"] * hd + 2 * d * c["n_kv_heads"] * hd + 3 * d * c["ffn_hidden"]
    return 6.0 * (c["n_layers"] * per_layer + c["vocab"] * d) + 12.0 * c["n_layers"] * d * c["seq_len"]


def flash_applies(c, device):
    """Whether SDPA's flash kernel takes this model's attention in bf16 (forward and backward,
    grouped-query as the model calls it), tried on a short sequence under sdpa_kernel(FLASH)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hd, gqa = c["dim"] // c["n_heads"], c["n_kv_heads"] != c["n_heads"]
    q = torch.zeros(1, c["n_heads"], 64, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.zeros(1, c["n_kv_heads"], 64, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward()
        return True
    except RuntimeError:
        return False


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-config", required=True, help="dtk's model_config JSON (arch llama), or a file holding it")
    p.add_argument("--tokens", required=True, help="raw little-endian token stream")
    p.add_argument("--tokens-dtype", default="uint16", choices=["uint16", "uint32"])
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"])
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global L2 norm (0: off)")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--compressor", default="none", choices=["none", "powersgd"])
    p.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    p.add_argument("--start-iter", type=int, default=10)
    p.add_argument("--min-compression-rate", type=float, default=2)
    p.add_argument("--bucket-size", default="25M", type=lambda v: float(v.rstrip("MmiB")) if v[-1:] in "Mm" or v.endswith(("MB", "MiB")) else float(v) / 2**20,
                   help="DDP's bucket size, as psgd-train's (25M; a plain number is bytes)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", help="start from the weights of a dtk checkpoint (shard-inspect export --format npz)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2: fully_shard per block and over the model")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor; the first step compiles, its time is logged)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (default), or cuda: one process on the current GPU")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                   help="f32 (default); bf16: autocast to bfloat16 around forward and loss, f32 master weights "
                        "(--device cuda only)")
    p.add_argument("--metrics", default="-", help="JSON-lines metrics file (- for stdout)")
    return p.parse_args(argv)


def load_windows(a, seq_len):
    """Every whole window of seq_len + 1 tokens at multiples of seq_len: [windows, seq_len + 1]."""
    with open(a.tokens, "rb") as f:
        data = bytearray(f.read())
    # torch 1.13 has no uint16: widen through int32 (tokens are below 2^31)
    if a.tokens_dtype == "uint16":
        tokens = torch.frombuffer(data, dtype=torch.int16).to(torch.int32) & 0xFFFF
    else:
        tokens = torch.frombuffer(data, dtype=torch.int32)
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        sys.exit(f"{a.tokens}: {tokens.numel()} tokens, fewer than one window of {seq_len + 1}")
    return tokens[: n * seq_len + 1].long().unfold(0, seq_len + 1, seq_len).contiguous()


def load_npz(model, path):
    """The weights model/NAME of a dtk checkpoint exported as npz; every name and shape must match."""
    import numpy as np
    z = np.load(path)
    theirs = {k[len("model/"):]: z[k] for k in z.files if k.startswith("model/")}
    ours = dict(model.named_parameters())
    if set(theirs) != set(ours):
        sys.exit(f"{path}: parameters differ; only in the checkpoint: {sorted(set(theirs) - set(ours))}, "
                 f"only here: {sorted(set(ours) - set(theirs))}")
    with torch.no_grad():
        for name, p in ours.items():
            if tuple(theirs[name].shape) != tuple(p.shape):
                sys.exit(f"{path}: {name} is {list(theirs[name].shape)} there, {list(p.shape)} here")
            p.copy_(torch.from_numpy(theirs[name]))


def main(argv):
    a = parse_args(argv)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", 0)))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    c = json.loads(a.model_config if a.model_config.lstrip().startswith("{") else open(a.model_config).read())
    if c.get("arch") != "llama":
        sys.exit(f"--model-config: arch {c.get('arch')!r}, only llama is supported")
    if a.global_batch % world:
        sys.exit(f"--global-batch {a.global_batch} does not split evenly over {world} processes")
    cuda = a.device == "cuda"
    if a.dtype == "bf16" and not cuda:
        sys.exit("--dtype bf16 needs --device cuda")
    if cuda and (world > 1 or a.fsdp):
        sys.exit("--device cuda trains in one process, without --fsdp")
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU")

    if cuda:
        with torch.device("cuda"):  # parameters and RoPE tables made on the GPU
            model = Llama(c)
    else:
        model = Llama(c)
    model.checkpointing = a.activation_checkpointing
    if a.init_from:
        load_npz(model, a.init_from)
    if a.fsdp:
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model)
        ddp = model
    elif world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_size)
        if a.compressor == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=a.rank, start_powerSGD_iter=a.start_iter,
                min_compression_rate=a.min_compression_rate, use_error_feedback=True, warm_start=True,
                random_seed=a.seed)
            ddp.register_comm_hook(state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
    else:
        ddp = model
    if a.compile:
        ddp = torch.compile(ddp)  # over DDP: dynamo splits the graph at the gradient buckets
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay,
                              **({"fused": True} if cuda else {}))
    # forward and loss under autocast (bf16), f32 otherwise
    autocast = (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if a.dtype == "bf16" else (
        lambda: contextlib.nullcontext())
    flops_per_token = train_flops_per_token(c)
    flash = flash_applies(c, a.device) if cuda else None

    windows = load_windows(a, c["seq_len"])
    share = a.global_batch // world
    rows = torch.arange(rank * share, (rank + 1) * share)
    tokens_per_step = a.global_batch * c["seq_len"]
    if rank == 0:
        print(f"pytorch_llama: torch {torch.__version__}, llama {sum(p.numel() for p in params)} parameters, "
              f"{world} process(es) x {torch.get_num_threads()} thread(s), {a.compressor}, "
              f"{windows.shape[0]} windows of {c['seq_len'] + 1} tokens", file=sys.stderr)
        if cuda:
            print(f"pytorch_llama: {torch.cuda.get_device_name()}, {a.dtype}"
                  f"{' (autocast)' if a.dtype == 'bf16' else ''}, fused AdamW, SDPA's flash kernel "
                  f"{'applies' if flash else 'does not apply'} to this attention in bf16", file=sys.stderr)
    out = (sys.stdout if a.metrics == "-" else open(a.metrics, "w")) if rank == 0 else None

    for step in range(a.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            persistent = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        lr = lr_at(step, a)
        for group in optim.param_groups:
            group["lr"] = lr
        batch = windows[(step * a.global_batch + rows) % windows.shape[0]]
        if cuda:
            batch = batch.to("cuda", non_blocking=True)
        with autocast():
            loss = ddp(batch[:, :-1], batch[:, 1:])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, a.clip) if a.clip > 0 else torch.zeros(())
        optim.step()
        # the global-batch mean loss, as psgd-train reports it (one small all-reduce)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        loss = loss.item()
        if cuda:
            torch.cuda.synchronize()  # the optimizer's kernels are part of the step
        dt = time.perf_counter() - t0
        if step == 0 and a.compile and rank == 0:
            print(f"pytorch_llama: torch.compile (inductor): the first step, compiling forward and backward, took "
                  f"{dt:.1f} s", file=sys.stderr)
        if not math.isfinite(loss):
            sys.exit(f"the loss is {loss} at step {step + 1}")
        if out:
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                      "tokens_per_s": tokens_per_step / dt, "model_flops_per_s": flops_per_token * tokens_per_step / dt,
                      "step_time_ms": dt * 1e3}
            if cuda:
                record.update({"peak_mem_bytes": torch.cuda.max_memory_allocated(), "persistent_mem_bytes": persistent})
                if step == 0:
                    record.update({"device": torch.cuda.get_device_name(), "dtype": a.dtype, "sdpa_flash": flash})
            if step == 0 and a.compile:
                record["compile_s"] = dt  # the first step: tracing and inductor's code generation
            out.write(json.dumps(record) + "\n")
            out.flush()
    if out:
        out.flush()
    if dist.is_initialized():
        # torch 1.13 can deadlock tearing gloo down at exit (the process group's destructor, run
        # with the GIL held, joins a worker thread that waits for the GIL): leave without it
        dist.barrier()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
