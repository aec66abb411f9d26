"""The warm-up's enumeration of attention launch configs is complete: every (rows, max_q, max_k) of a
serving domain maps onto a config it lists (checked by brute force over small domains and by
sampling a real one), and each listed config is produced by its representative shape. On the GPU:
after the warm-up, random serving-shaped launches build no new Triton variant."""

from __future__ import annotations

import random

import pytest
import torch

from specsched.kernels.attention_variants import AttentionDomain, launch_configs
from specsched.kernels.triton_attention import launch_config

SMS = 132


def brute_force(d: AttentionDomain, num_sms: int) -> set:
    out = set()
    for max_q in range(1, d.max_q + 1):
        rows_max = d.max_rows_single if max_q == 1 else d.max_rows_multi
        for rows in range(1, rows_max + 1):
            for max_k in range(max_q, d.max_keys + 1):
                out.add(launch_config(max_q, max_k, rows, d.group, d.kv_heads, d.head_dim, num_sms=num_sms))
    return out


@pytest.mark.parametrize(
    "domain, num_sms",
    [
        (AttentionDomain(8, 2, 64, max_rows_single=40, max_rows_multi=9, max_q=70, max_keys=300), 16),
        (AttentionDomain(4, 4, 128, max_rows_single=12, max_rows_multi=6, max_q=40, max_keys=600), 8),
        (AttentionDomain(9, 3, 64, max_rows_single=20, max_rows_multi=20, max_q=9, max_keys=200), 132),
    ],
)
def test_enumeration_equals_brute_force_on_small_domains(domain: AttentionDomain, num_sms: int) -> None:
    found = launch_configs(domain, num_sms)
    assert set(found) == brute_force(domain, num_sms)
    for cfg, (rows, max_q, max_k) in found.items():  # each representative yields its config
        assert launch_config(max_q, max_k, rows, domain.group, domain.kv_heads, domain.head_dim,
                             num_sms=num_sms) == cfg  # fmt: skip


def test_random_serving_shapes_of_a_real_domain_are_covered() -> None:
    # SmolLM2-135M (9 heads, 3 KV heads, head_dim 64) served with 64 sequences, k <= 8, 2048-token
    # chunks and 8192-token rows: too large to brute-force, so sample it
    d = AttentionDomain(9, 3, 64, max_rows_single=1024, max_rows_multi=64, max_q=2048, max_keys=8192)
    found = set(launch_configs(d, SMS))
    rng = random.Random(0)
    for _ in range(3000):
        max_q = 1 if rng.random() < 0.4 else rng.randint(1, d.max_q)
        rows = rng.randint(1, d.max_rows_single if max_q == 1 else d.max_rows_multi)
        max_k = rng.randint(max_q, d.max_keys)
        assert launch_config(max_q, max_k, rows, 3, 3, 64, num_sms=SMS) in found, (rows, max_q, max_k)
    assert 5 <= len(found) <= 80  # a warm-up of seconds, not minutes


def test_domain_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="max_keys must be >= 1"):
        AttentionDomain(8, 2, 64, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="not a multiple of kv_heads"):
        AttentionDomain(9, 2, 64, 1, 1, 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_no_variant_built_after_the_warm_up() -> None:
    from specsched.kernels.attention_variants import warm_up_attention
    from specsched.kernels.compile_watch import CompileWatch
    from specsched.kernels.metadata import build_metadata
    from specsched.kernels.triton_attention import paged_attention_triton

    watch = CompileWatch()
    assert watch.install()
    d = AttentionDomain(8, 2, 128, max_rows_single=72, max_rows_multi=8, max_q=300, max_keys=1000)
    bs, nb = 16, 600
    kc = torch.randn(nb, bs, 2, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    warm_up_attention(list(launch_configs(d, torch.cuda.get_device_properties(0).multi_processor_count)),
                      kc, vc, 8, 128**-0.5)  # fmt: skip
    torch.cuda.synchronize()
    built = watch.num_built
    watch.mark_ready()
    rng = random.Random(1)
    for _ in range(60):  # decode, batch expansion, MQA and prefill-shaped launches
        kind = rng.choice(["decode", "mqa", "prefill"])
        rows = rng.randint(1, d.max_rows_single if kind == "decode" else d.max_rows_multi)
        q_lens = [1 if kind == "decode" else rng.randint(1, 9 if kind == "mqa" else 300) for _ in range(rows)]
        k_lens = [rng.randint(q, d.max_keys) for q in q_lens]
        tables = [[rng.randrange(1, nb) for _ in range(-(-k // bs))] for k in k_lens]
        meta = build_metadata(q_lens, k_lens, tables, bs, "cuda")
        q = torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
        paged_attention_triton(q, kc, vc, meta, 128**-0.5)
    torch.cuda.synchronize()
    print(f"variants built by the warm-up: {built}, after it: {watch.num_after_ready}")
    assert built > 0
    assert watch.num_after_ready == 0, [e.signature for e in watch.after_ready()]
