"""Inductor against our kernels for a decoder layer's dense parts (issue 17): ``torch.compile`` of the
norm + QKV projection before attention and of the output projection + norm + SwiGLU MLP after it
(plain torch ops, Inductor fuses the pointwise work and picks the GEMMs), with our rotary + KV store
and paged attention between, as vLLM V1 compiles around its attention; all captured in one CUDA graph
per variant, as the engine's graphs are.

    python -m specsched.bench.inductor_layer [--models smollm2 7b] [--rows 1 4 16] [--ctx 512]
        [--mode default|max-autotune-no-cudagraphs] [--repeats 5] [--replays 200]

CUDA only (exits 2 elsewhere). Random bf16 weights in the model's shape; each of M rows decodes one
token over ``--ctx`` cached tokens. Prints a markdown table: one layer and the whole forward (30 / 32
layers, embedding to logits) as us per graph replay, median over ``--repeats`` runs of ``--replays``
replays (min-max), ours and Inductor alternating; the kernels of one replay (torch.profiler); the
relative difference of the Inductor forward's logits from ours.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specsched.bench.fused_linear import (
    MODELS,
    compare,
    decode_batch,
    fmt_count,
    fmt_runs,
    graph_of,
    kernels_per_replay,
)
from specsched.kernels.norm import add_rms_norm_ref, rms_norm_ref


def dense_pre(x, residual, w_ln, eps: float, w_qkv):  # [T, H], [T, H] | None -> ([T, QKV], [T, H])
    """Layer input: the residual add, RMSNorm and the QKV projection (the torch references of our
    kernels, for Inductor to fuse)."""
    if residual is None:
        h, r = rms_norm_ref(x, w_ln, eps), x
    else:
        h, r = add_rms_norm_ref(x, residual, w_ln, eps)
    return F.linear(h, w_qkv), r


def dense_post(o, residual, w_o, w_ln, eps: float, w_gate_up, w_down):  # [T, Q], [T, H] -> ([T, H], [T, H])
    """After attention: the output projection, the residual add + RMSNorm and the SwiGLU MLP."""
    h, r = add_rms_norm_ref(F.linear(o, w_o), residual, w_ln, eps)
    gate, up = F.linear(h, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down), r


class CompiledLayer:
    """A :class:`~specsched.models.llama.LlamaDecoderLayer`'s forward with its dense parts compiled."""

    def __init__(self, layer, pre, post) -> None:
        self.layer, self.pre, self.post = layer, pre, post

    def __call__(self, x, residual, cos, sin, kv, meta, attn):
        from specsched.kernels.rotary import rotary_store_kv

        ly, sa, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        ln1, ln2 = ly.input_layernorm, ly.post_attention_layernorm
        qkv, residual = self.pre(x, residual, ln1.weight, ln1.eps, sa.qkv_proj.weight)
        q = rotary_store_kv(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, sa.num_heads, sa.num_kv_heads)
        o = attn(q, kv[0], kv[1], meta, sa.scale).reshape(qkv.shape[0], sa.q_size)
        return self.post(o, residual, sa.o_proj.weight, ln2.weight, ln2.eps, mlp.gate_up_proj.weight,
                         mlp.down_proj.weight)  # fmt: skip


def forward_with(model, layers, ids, pos, meta, kv) -> torch.Tensor:  # [M, vocab] float32
    """``model``'s forward with ``layers`` (callables like a decoder layer) in place of its own."""
    freqs = pos.float()[:, None] * model.inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    x, residual = model.model.embed_tokens(ids), None
    for layer, cache in zip(layers, kv):
        x, residual = layer(x, residual, cos, sin, cache, meta, model.attn)
    return model.lm_head(model.model.norm.add_and_norm(x, residual)[0]).float()


def bench_model(key: str, args) -> None:
    from specsched.bench.common import random_model

    model = random_model(MODELS[key], torch.device("cuda"), torch.bfloat16, is_decisive=False)
    pre = torch.compile(dense_pre, mode=args.mode, fullgraph=True, dynamic=False)
    post = torch.compile(dense_post, mode=args.mode, fullgraph=True, dynamic=False)
    compiled = [CompiledLayer(ly, pre, post) for ly in model.model.layers]
    for m in args.rows:
        with torch.inference_mode():
            cells = bench_rows(key, model, compiled, m, args)
        print("| " + " | ".join(cells) + " |", flush=True)
        torch.cuda.empty_cache()


def bench_rows(key: str, model, compiled: list[CompiledLayer], m: int, args) -> list[str]:
    """One table row: layer 0 and the whole forward at M = ``m``, ours against Inductor."""
    t0 = time.perf_counter()
    ids, pos, meta, kv = decode_batch(model, m, args.ctx)
    x = torch.randn(m, model.cfg.hidden_size, device="cuda").bfloat16()
    freqs = pos.float()[:, None] * model.inv_freq[None, :]
    layer_args = (x, torch.randn_like(x), freqs.cos(), freqs.sin(), kv[0], meta, model.attn)
    out: dict[str, torch.Tensor] = {}
    graphs = {
        "ours layer": graph_of(lambda: model.model.layers[0](*layer_args)),
        "inductor layer": graph_of(lambda: compiled[0](*layer_args)),
        "ours forward": graph_of(lambda: out.__setitem__("ours", model(ids, pos, meta, kv))),
        "inductor forward": graph_of(
            lambda: out.__setitem__("inductor", forward_with(model, compiled, ids, pos, meta, kv))
        ),
    }
    compile_s = time.perf_counter() - t0  # the first M's includes Inductor's compiles
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    diff = float((out["inductor"] - out["ours"]).norm() / out["ours"].norm())
    runs = compare(graphs, args.repeats, args.replays)
    counts = {n: None if args.no_profile else kernels_per_replay(g) for n, g in graphs.items()}
    cells = [key, str(m)]
    for part in ("layer", "forward"):
        ours, ind = runs[f"ours {part}"], runs[f"inductor {part}"]
        ratio = statistics.median(ind) / statistics.median(ours)
        kernels = f"{fmt_count(counts[f'ours {part}'])} / {fmt_count(counts[f'inductor {part}'])}"
        cells += [fmt_runs(ours), fmt_runs(ind), f"{ratio:.2f}", kernels]
    return [*cells, f"{diff:.1e}", f"{compile_s:.0f}"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--mode", default="default", help="torch.compile mode (no cudagraphs: ours capture)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel counts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("inductor_layer needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    if "cudagraphs" in args.mode and "no-cudagraphs" not in args.mode:
        ap.error("--mode with Inductor's own CUDA graphs cannot be captured inside ours")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, mode {args.mode}, ctx {args.ctx}\n")
    head = ["model", "M", "layer us ours", "layer us Inductor", "ratio", "kernels", "forward us ours",
            "forward us Inductor", "ratio", "kernels", "logits rel. diff", "capture s"]  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head), flush=True)
    for key in args.models:
        bench_model(key, args)


if __name__ == "__main__":
    main()
