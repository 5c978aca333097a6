"""A GPT-2 forward pass in NumPy, for the model test (tests/tests/models.rs).

Reads a safetensors file as Hugging Face lays out GPT-2 (with config.json beside it), runs
the model on a byte prompt and compares its next-token probabilities with those shoal wrote,
then continues the prompt greedily and prints the text, for the test to compare with
`shoal generate --temperature 0`.

usage: gpt2_numpy.py MODEL.safetensors PROMPT PROBABILITIES.json TOKENS
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def layernorm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu(x):
    # GPT-2's tanh approximation ("gelu_new").
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def forward(p, cfg, tokens):
    """Next-token probabilities (T, vocab) for a sequence of token ids."""
    t = len(tokens)
    c, heads = cfg["n_embd"], cfg["n_head"]
    hd = c // heads
    x = p["transformer.wte.weight"][tokens] + p["transformer.wpe.weight"][:t]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for l in range(cfg["n_layer"]):
        h = f"transformer.h.{l}."
        a = layernorm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
        qkv = a @ p[h + "attn.c_attn.weight"] + p[h + "attn.c_attn.bias"]
        q, k, v = np.split(qkv, 3, axis=-1)
        q = q.reshape(t, heads, hd).transpose(1, 0, 2)
        k = k.reshape(t, heads, hd).transpose(1, 0, 2)
        v = v.reshape(t, heads, hd).transpose(1, 0, 2)
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(1, 0, 2).reshape(t, c)
        x = x + y @ p[h + "attn.c_proj.weight"] + p[h + "attn.c_proj.bias"]
        m = layernorm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
        m = gelu(m @ p[h + "mlp.c_fc.weight"] + p[h + "mlp.c_fc.bias"])
        x = x + m @ p[h + "mlp.c_proj.weight"] + p[h + "mlp.c_proj.bias"]
    x = layernorm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
    head = p.get("lm_head.weight", p["transformer.wte.weight"])
    logits = x @ head.T
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def main():
    model, prompt, probs_path, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with open(os.path.join(os.path.dirname(model), "config.json")) as f:
        cfg = json.load(f)
    p = {k: v.astype(np.float64) for k, v in load_file(model).items()}
    tokens = list(prompt.encode())
    ours = forward(p, cfg, tokens)
    with open(probs_path) as f:
        theirs = np.array(json.load(f), dtype=np.float64)
    if theirs.shape != ours.shape:
        sys.exit(f"shapes differ: shoal {theirs.shape}, numpy {ours.shape}")
    diff = np.abs(ours - theirs).max()
    logdiff = np.abs(np.log(np.maximum(ours, 1e-30)) - np.log(np.maximum(theirs, 1e-30)))
    logdiff = logdiff[ours > 1e-4].max()
    print(f"max probability difference {diff:.3g}; max log-probability difference {logdiff:.3g}")
    if diff > 1e-4 or logdiff > 1e-3:
        sys.exit("shoal and numpy disagree")
    for _ in range(n):
        window = tokens[-cfg["n_positions"]:]
        tokens.append(int(forward(p, cfg, window)[-1].argmax()))
    print("greedy:", json.dumps(bytes(tokens).decode("utf-8", "replace")))


if __name__ == "__main__":
    main()
