#!/usr/bin/env python3
"""PyTorch eager reference benchmark for shoal's GPT training step.

What it measures
----------------
Wall-clock time of one complete float32 training step of a GPT-2 style
decoder on the CPU (or, with --device cuda, an NVIDIA GPU), using stock
PyTorch eager mode (no torch.compile). The model and step are the same as the
Rust implementation in `compute`, so the numbers are a like-for-like baseline:

  * token embedding wte (V, C) + learned position embedding wpe (T, C)
  * L pre-LayerNorm blocks:  x = x + attn(ln1(x));  x = x + mlp(ln2(x))
      - attn: fused qkv Linear(C, 3C, bias) -> causal multi-head
        self-attention -> Linear(C, C, bias)
      - mlp:  Linear(C, 4C, bias) -> GELU(tanh approx) -> Linear(4C, C, bias)
      - LayerNorm eps 1e-5 with weight and bias
  * final LayerNorm, LM head tied to wte (logits = x @ wte^T, no bias)

One step = zero_grad(set_to_none=True), forward on B random sequences of
length T, mean cross-entropy against random targets, backward,
clip_grad_norm_(1.0), AdamW step (lr 3e-4, betas (0.9, 0.95), eps 1e-8,
weight_decay 0.1 on parameters with dim >= 2 only).

Each step is timed as a whole with time.perf_counter(): 3 untimed warm-up
steps, then --steps timed steps (at least 10). The report gives the median and
minimum step time, tokens/s (B*T / median seconds) and achieved GFLOP/s from
the analytical FLOP count documented at `flops_per_step` below. On CUDA each
timed step ends with torch.cuda.synchronize(), so it counts the GPU's work, not
just its queueing; matrix products stay float32 (PyTorch's default, no TF32),
as in shoal.

How to run
----------
    python3 compute/benches/torch_reference.py --preset micro --batch 8 --threads 2 --json
    python3 compute/benches/torch_reference.py --preset nano --batch 4 --threads 1 --steps 10
    python3 compute/benches/torch_reference.py --preset micro --attn manual
    python3 compute/benches/torch_reference.py --preset gpt2 --batch 8 --device cuda

Requires `torch` (CPU wheels are fine; CUDA is used only with --device cuda).
With --json a single JSON object is printed on stdout; otherwise one readable
line.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Model shapes: vocab V, context T, width C, layers L, heads NH.
PRESETS = {
    "nano": dict(V=256, T=64, C=64, L=2, NH=4),
    "micro": dict(V=256, T=128, C=256, L=6, NH=8),
    "mini": dict(V=256, T=256, C=512, L=8, NH=8),
    "gpt2": dict(V=50257, T=1024, C=768, L=12, NH=12),
}

WARMUP_STEPS = 3
MIN_TIMED_STEPS = 10


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, C, NH, T, attn_impl):
        super().__init__()
        assert C % NH == 0, "width must be divisible by the number of heads"
        self.C, self.NH, self.hd = C, NH, C // NH
        self.attn_impl = attn_impl
        self.qkv = nn.Linear(C, 3 * C, bias=True)
        self.proj = nn.Linear(C, C, bias=True)
        self.proj.is_residual_out = True  # gets the scaled init
        if attn_impl == "manual":
            # Lower-triangular mask: position i may attend to j <= i.
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, T, T), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, NH, T, hd)
        q = q.view(B, T, self.NH, self.hd).transpose(1, 2)
        k = k.view(B, T, self.NH, self.hd).transpose(1, 2)
        v = v.view(B, T, self.NH, self.hd).transpose(1, 2)
        if self.attn_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Explicit version: softmax(q k^T / sqrt(hd) + causal mask) v
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.fc = nn.Linear(C, 4 * C, bias=True)
        self.proj = nn.Linear(4 * C, C, bias=True)
        self.proj.is_residual_out = True  # gets the scaled init

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, C, NH, T, attn_impl):
        super().__init__()
        self.ln1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = CausalSelfAttention(C, NH, T, attn_impl)
        self.ln2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = MLP(C)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, V, T, C, L, NH, attn_impl="sdpa"):
        super().__init__()
        self.V, self.T, self.C, self.L = V, T, C, L
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.blocks = nn.ModuleList([Block(C, NH, T, attn_impl) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        # No separate lm_head module: the head is tied to wte (see forward).
        self._init_weights()

    def _init_weights(self):
        residual_std = 0.02 / math.sqrt(2 * self.L)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                std = residual_std if getattr(m, "is_residual_out", False) else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C) + (T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.t()  # tied LM head, (B, T, V)


def flops_per_step(n_params, L, B, T, C):
    """Analytical FLOPs of one training step (forward + backward).

    6 * N * B * T : every parameter takes part in one multiply-add (2 FLOPs)
                    per token in the forward pass and two in the backward pass
                    (grad wrt input and grad wrt weight): 2 + 4 = 6. N counts all
                    unique parameters (tied wte once; it is used as the LM
                    head matmul, and its small embedding-lookup/LayerNorm/bias
                    overcount is accepted for simplicity).
    6 * L * B * T * T * C : attention scores q k^T and att @ v are each
                    2 * B * T * T * C FLOPs forward per layer (summed over
                    heads); forward + backward = 3x, and the causal mask is
                    credited as halving the work: 2 matmuls * 2 * 3 / 2 = 6.
    The optimizer, softmax, GELU, LayerNorm and loss are not counted.
    """
    return 6 * n_params * B * T + 6 * L * B * T * T * C


def make_optimizer(model, impl):
    """AdamW with weight decay only on parameters with dim >= 2.

    impl selects the PyTorch AdamW kernel: 'foreach' (multi-tensor ops, the
    default on CPU), 'fused' (single fused CPU kernel, available since torch
    2.4) or 'forloop' (per-parameter loop). All three compute the same update.
    'fused' is the default here: on CPU it was measured the fastest (see the
    --optim help), and it is numerically equivalent to the others.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # unique
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return torch.optim.AdamW(groups, **kwargs)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="PyTorch eager reference timing of one GPT training step."
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="micro")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (B)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--steps", type=int, default=20,
        help=f"timed steps after {WARMUP_STEPS} warm-up steps (min {MIN_TIMED_STEPS})",
    )
    p.add_argument(
        "--attn", choices=["sdpa", "manual"], default="sdpa",
        help="sdpa: F.scaled_dot_product_attention(is_causal=True); "
        "manual: explicit masked softmax",
    )
    p.add_argument(
        "--optim", choices=["fused", "foreach", "forloop"], default="fused",
        help="AdamW implementation (default fused: fastest on CPU in our runs, "
        "same results as foreach)",
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="where the step runs (cuda: GPU 0)",
    )
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.steps < MIN_TIMED_STEPS:
        p.error(f"--steps must be at least {MIN_TIMED_STEPS}")
    if args.batch < 1 or args.threads < 1:
        p.error("--batch and --threads must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda
        p.error(
            f"--device cuda: torch {torch.__version__} "
            + (f"(built for CUDA {built}) finds no usable GPU: no GPU, or a driver too "
               "old for that CUDA release" if built else "is a CPU-only build")
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    # Thread settings first, before any parallel work has started.
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(args.seed)

    cfg = PRESETS[args.preset]
    V, T, C, L, NH = cfg["V"], cfg["T"], cfg["C"], cfg["L"], cfg["NH"]
    B = args.batch

    # Built on the CPU and then moved, so the initial weights are the same on every device.
    device = torch.device(args.device)
    model = GPT(V, T, C, L, NH, attn_impl=args.attn).to(device)
    model.train()
    params = list(model.parameters())  # unique: the tied wte appears once
    n_params = sum(p.numel() for p in params)
    optimizer = make_optimizer(model, args.optim)

    # One fixed random batch; its content does not affect the timing.
    x = torch.randint(0, V, (B, T), dtype=torch.long).to(device)
    y = torch.randint(0, V, (B, T), dtype=torch.long).to(device)
    # CPU eager is synchronous; on CUDA, step() returns once the work is queued.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss

    losses = []
    for _ in range(WARMUP_STEPS):
        losses.append(step().item())

    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())

    median_s = statistics.median(times)
    device_name = args.device
    if device.type == "cuda":
        device_name = f"cuda ({torch.cuda.get_device_name(device)})"
    flops = flops_per_step(n_params, L, B, T, C)
    result = {
        "framework": "pytorch",
        "torch_version": torch.__version__,
        "device": device_name,
        "preset": args.preset,
        "batch": B,
        "context": T,
        "threads": args.threads,
        "attn": args.attn,
        "optim": args.optim,
        "steps": args.steps,
        "params": n_params,
        "step_ms_median": median_s * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tokens_per_s": B * T / median_s,
        "gflops": flops / median_s / 1e9,  # achieved GFLOP/s at the median
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"pytorch {torch.__version__} {result['device']} preset={args.preset} B={B} T={T} "
            f"threads={args.threads} attn={args.attn} optim={args.optim} "
            f"params={n_params:,} step median {result['step_ms_median']:.2f} ms "
            f"(min {result['step_ms_min']:.2f} ms) "
            f"{result['tokens_per_s']:,.0f} tok/s {result['gflops']:.2f} GFLOP/s "
            f"loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
