#!/usr/bin/env python3
"""PyTorch's causal attention timed as attention-bench times dtk's: the baseline of its JSON line.

torch.nn.functional.scaled_dot_product_attention(is_causal=True) on [B, H, T, hd] tensors, for
bf16 under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (FlashAttention-2 inside PyTorch); grouped-query
heads (--kv-heads < --heads) through enable_gqa=True, which that backend supports, so k and v stay
[B, Hkv, T, hd] as in dtk. f32 has no flash kernel: it runs under the efficient and math backends.
Random normal inputs on the GPU, 3 warm-up iterations, then --iters forward calls timed between two
torch.cuda.Events, then the backwards of --iters forwards (torch.autograd.grad with dout) timed the
same way. FLOPs as FlashAttention counts them for causal attention:
forward 4 B H T^2 hd / 2, backward 2.5 times that. Prints one line of JSON; exits 77 without a GPU.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    a = ap.parse_args()
    if min(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim, a.iters) < 1 or a.heads % a.kv_heads:
        sys.exit("pytorch_attention.py: sizes must be positive and --heads a multiple of --kv-heads")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("pytorch_attention.py: no GPU", file=sys.stderr)
        sys.exit(77)
    dev = torch.device("cuda")
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    backends = [SDPBackend.FLASH_ATTENTION] if a.dtype == "bf16" else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    g = torch.Generator(device=dev).manual_seed(1)

    def rand(h):
        return torch.randn(a.batch, h, a.seq, a.head_dim, generator=g, device=dev, dtype=dt)

    q, k, v = rand(a.heads).requires_grad_(), rand(a.kv_heads).requires_grad_(), rand(a.kv_heads).requires_grad_()
    dout = rand(a.heads)
    gqa = a.kv_heads != a.heads

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    with sdpa_kernel(backends):
        for _ in range(3):
            forward().backward(dout)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad():
            e0.record()
            for _ in range(a.iters):
                forward()
            e1.record()
        torch.cuda.synchronize()
        fwd_ms = e0.elapsed_time(e1) / a.iters
        # The backward alone: the graphs of --iters forwards first, then their backwards back to
        # back between two events (autograd.grad: no accumulation into .grad).
        outs = [forward() for _ in range(a.iters)]
        torch.cuda.synchronize()
        e0.record()
        for out in outs:
            torch.autograd.grad(out, (q, k, v), dout)
        e1.record()
        torch.cuda.synchronize()
        bwd_ms = e0.elapsed_time(e1) / a.iters

    flops = 4.0 * a.batch * a.heads * a.seq * a.seq * a.head_dim / 2
    print(json.dumps({
        "impl": "sdpa", "dtype": a.dtype, "B": a.batch, "T": a.seq, "H": a.heads, "Hkv": a.kv_heads,
        "hd": a.head_dim, "fwd_ms": round(fwd_ms, 4), "bwd_ms": round(bwd_ms, 4),
        "fwd_tflops": round(flops / fwd_ms / 1e9, 1), "bwd_tflops": round(2.5 * flops / bwd_ms / 1e9, 1),
        "fwdbwd_tflops": round(3.5 * flops / (fwd_ms + bwd_ms) / 1e9, 1)}))


if __name__ == "__main__":
    main()
