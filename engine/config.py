"""Config dataclasses, one per layer. Hydra builds them at the entry points (``OmegaConf.to_object``);
core code only ever sees these dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The target model. ``source`` is a preset name (random init), an HF folder, a ``.gguf`` file,
    or ``smollm2`` (the embedded SmolLM2-135M-Instruct)."""

    source: str = "smollm2"
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda when available
    attn_backend: str = "auto"  # auto = triton on CUDA, torch on CPU; or torch | triton | flash_attn
    seed: int = 0  # random-init seed for presets
    cache_dir: str | None = None  # converted weights cache; None = $SPECSCHED_CACHE_DIR or ~/.cache/specsched
    max_model_len: int | None = None  # None = the model's own
    cuda_graphs: bool = True  # capture batch-expansion / MQA / draft graphs on CUDA
    # Build every Triton kernel variant serving can launch at start-up (engine/warmup.py), so none
    # compiles while serving: auto = on CUDA, on, off.
    kernel_warmup: str = "auto"
    # A token's target logits independent of the batch, the scorer, k and the other requests, bit for
    # bit (batch-invariant GEMMs, attention split at fixed key positions): speculation then is exactly
    # lossless in bf16 too. Needs attn_backend auto or triton on CUDA (torch: CPU only). Costs speed.
    deterministic: bool = False
    # Forwards of <= 16 token rows on CUDA (decode / verify) run RMSNorm (+ residual add) inside the
    # QKV, gate/up and LM-head GEMMs and SiLU-mul in the gate/up GEMM (kernels/fused_linear.py):
    # fewer launches per layer. Off until measured on the H200; not with deterministic (docs/models.md).
    fused_linear: bool = False
    # With fused_linear: the attention output and down projections (no prologue to fuse) also in the
    # small-M Triton kernel instead of cuBLAS (kernels/small_linear.py: no split-K second launch).
    # Off until bench.fused_linear measures it on the H200.
    fused_linear_gemms: bool = False
    # Programmatic dependent launch (kernels/pdl.py) for our Triton kernels on Hopper and later: each
    # may start while the kernel before it runs, fetching its weights first and waiting before it
    # reads that kernel's output. Process-wide (the draft shares it). Off: on the H200 on 2026-12-06
    # (bench=serve_pdl_ab) the fused layers + own GEMMs with it gave +2 % tok/s at N = 1, none above.
    pdl: bool = False
    pdl_trigger: str = "after"  # a kernel lets the next start after (or before) its own wait
    pdl_prefetch_max_mb: float = 8.0  # a kernel prefetches its weight rows if its weight is this small
    # Prefill chunks of up to this many tokens and prompts run on CUDA graphs (each row's last
    # token's logits; tokens capped by scheduler.max_num_batched_tokens, prompts by max_num_seqs).
    # With the graphs captured, the scheduler keeps every prefill step within them: an eager
    # prefill forward is launch-bound (SmolLM2 on the H200: 11-31 ms against ~1.5 ms on a graph).
    # 0 tokens: every prefill eager, chunked by the budget alone.
    prefill_graph_tokens: int = 2048
    prefill_graph_rows: int = 16
    # The eager MQA scorer (``mqa``) on piecewise CUDA graphs: every op but the attention replayed per
    # token count, the attention eager over the batch's own rows, any k (models/piecewise_graphs.py).
    # Off until its GPU tests and bench.scorers measure it.
    piecewise_graphs: bool = False

    def __post_init__(self) -> None:
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"model.prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.prefill_graph_rows < 1:
            raise ValueError(f"model.prefill_graph_rows must be >= 1, got {self.prefill_graph_rows}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.kernel_warmup not in ("auto", "on", "off"):
            raise ValueError(f"model.kernel_warmup must be auto, on or off, got {self.kernel_warmup!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"model.deterministic must be true or false, got {self.deterministic!r}")
        if not isinstance(self.fused_linear, bool):
            raise ValueError(f"model.fused_linear must be true or false, got {self.fused_linear!r}")
        if not isinstance(self.fused_linear_gemms, bool):
            got = self.fused_linear_gemms
            raise ValueError(f"model.fused_linear_gemms must be true or false, got {got!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"model.pdl must be true or false, got {self.pdl!r}")
        if self.pdl_trigger not in ("after", "before"):
            raise ValueError(f"model.pdl_trigger must be after or before, got {self.pdl_trigger!r}")
        if not self.pdl_prefetch_max_mb >= 0:
            raise ValueError(f"model.pdl_prefetch_max_mb must be >= 0, got {self.pdl_prefetch_max_mb}")
        if self.fused_linear_gemms and not self.fused_linear:
            raise ValueError("model.fused_linear_gemms=true needs model.fused_linear=true")
        if self.fused_linear and self.deterministic:
            raise ValueError(
                "model.fused_linear cannot be combined with model.deterministic: only forwards of up to "
                "16 rows are fused, so a token's logits would depend on its batch's size (docs/models.md)"
            )
        if self.deterministic and self.attn_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"model.deterministic needs attn_backend auto, triton or torch (CPU); "
                f"{self.attn_backend!r} has no deterministic mode"
            )


@dataclass
class DraftConfig:
    """The draft model for the ``draft`` proposer. ``source``: ``self`` (the target's first
    ``num_layers`` layers + its head), a preset, an HF folder or a ``.gguf`` file."""

    source: str = "self"
    num_layers: int = 8  # for source=self
    seed: int = 1
    # source=self: the draft reads and writes the target's KV cache of its layers (the same weights over
    # the same tokens give the same K/V): no cache of its own and no catch-up over a new request's
    # prompt (proposers/draft.py). false: a separate cache, filled by the draft itself.
    shared_kv: bool = True
    # On CUDA graphs: a greedy propose's single-token steps in one graph replay, their inputs computed
    # on the device (models/draft_loop.py), instead of an upload and a launch each: drafts 2..k after
    # the catch-up, all k for a self-draft on the target's cache. Off until bench.draft_loop measures
    # it on the GPU.
    loop_graphs: bool = False

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if not isinstance(self.shared_kv, bool):
            raise ValueError(f"draft.shared_kv must be true or false, got {self.shared_kv!r}")
        if not isinstance(self.loop_graphs, bool):
            raise ValueError(f"draft.loop_graphs must be true or false, got {self.loop_graphs!r}")


@dataclass
class NgramConfig:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not (1 <= self.min_n <= self.max_n):
            raise ValueError(f"need 1 <= ngram.min_n <= ngram.max_n, got {self.min_n}, {self.max_n}")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None = sized from memory_fraction (GPU) or cpu_kv_gb (CPU)
    gpu_memory_fraction: float = 0.8
    cpu_kv_gb: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"cache.block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"cache.num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 2048  # prefill chunk budget per step
    max_queue: int = 1024  # waiting requests at most (more: error 'overloaded')
    # Decide the next decode step's plan while the GPU runs this step's scoring, for policies that
    # allow it (Policy.is_plan_ahead_safe): auto = on CUDA, on, off. See Engine._decode.
    plan_ahead: str = "auto"
    # Plan ahead only at batches of at most this many requests (null: any). A plan decided ahead
    # offers every request spec.max_k (its offer is a step old), which prices the whole batch
    # drafting and plans fewer drafts than the offers allow (replay of the 2026-12-06 H100 serve log,
    # N = 64: -2.4 % tokens per request-step), while a host-bound step at batch 64 hides little of
    # the decide. Above this size the due decide runs on the step, on its offers, unless at most a
    # quarter of the batch had its offer cut (a draft model's: the ahead view is then the step's
    # batch, and behind a GPU-bound 7B forward the decide ahead is hidden). 16: on that H100
    # (bench=serve_plan_ab, 5 rounds) deciding on the step past batch 1 gave goodput +7.8 % per round
    # at N = 64 [+0.1 - +16.7], -2.2 % [-15.4 - +0.6] at N = 16, -0.2 % at N = 4. docs/policies.md.
    plan_ahead_max_batch: int | None = 16
    # The share of a decode step's time that deciding may cost: a plan whose decide the step waits
    # for (on the critical path, or planned ahead but longer than the GPU's scoring) is used for
    # up to max_plan_age steps, so that deciding costs about this share (engine/planning.py). For
    # policies that allow plan-ahead; null: decide every step. 0.02: on the H200 (2026-12-04 17:02,
    # bench=serve_rounds, both in the same rounds) goodput at 0.02 against 0.05 was +2.6 % at N = 16 and
    # +8 % at N = 64, within the spread at N = 1 and 4 (docs/benchmarks.md).
    decide_budget: float | None = 0.02
    # max_plan_age 16 with max_joined_share 0.5 (8 and 0.125 before): on the H100 on 2026-12-06
    # (bench=serve_verdict_carry, 5 rounds, both beside fixed k = 8) goodput's tok/s went 3,987 ->
    # 4,135 / 10,459 -> 11,610 / 20,249 -> 21,062 at N = 4 / 16 / 64 (k = 8: 4,061 / 10,594 /
    # 21,057), with 0.38 decides a decode step instead of 0.44; at N = 1 986 against 1,007, where
    # plans were fresh on 85-87 % of the steps either way (a decide there is ~0.12 ms, hidden).
    max_plan_age: int = 16
    # A held plan is due when more than this share of the batch (at least 1 request) joined since it
    # was decided (engine/planning.py). With plan-ahead the newcomers run the held plan meanwhile,
    # drafting like their nearest kept requests. At N = 16 on the H200 (2026-12-04 21:20) 0.125 made
    # goodput decide every ~5 steps whatever the budget and cap (2 joins), ~1.2 ms of host time each.
    max_joined_share: float = 0.5
    # What a decide ahead costs in that budget: "exposed" = the part of it the steps waited for (its
    # step's host time after the scoring launch beyond that of steps that decided nothing, and the
    # next step's loop, first event record and scoring launch beyond those of steps not after a
    # decide ahead: the daemon's other threads' work the decide kept out of the device wait);
    # "step" = its own step's part alone (the measure before 2026-12-06, for A/B runs); "host" = all
    # of its host ms (view + decide) (engine/planning.py).
    decide_cost: str = "exposed"
    # The decide interval doubles with each decide in a row that gave the plan it replaced (the same
    # scorer and k for every request both were decided for), up to max_plan_age; a changed plan
    # resets it (engine/planning.py). On the H100 on 2026-12-06 at N = 4, 76 % of goodput's decides
    # returned the plan held. Off: on the H200 on 2026-12-06 (bench=serve_spill_ab, 3 rounds) it gave
    # 4,464 / 15,111 / 27,044 tok/s at N = 4 / 16 / 64 against the default's 4,776 / 14,820 / 29,779.
    decide_backoff: bool = False
    # A held plan that became due only after the last step's decide-ahead check (the interval shrank
    # as its EMAs moved) runs one step more while that step's scoring decides the next one ahead,
    # instead of a decide on the step's critical path (engine/planning.py). On an H100 on 2026-12-07
    # (bench=serve_grounded, N = 1) it cut goodput's on-step decides from 10 % to 2 % of its steps,
    # but goodput then decided ahead on 0.69 steps in 1 instead of 0.36 and its steps ran 0.1 ms
    # longer than k = 8's at the same shape (a noisier host than the run before it): off until an
    # A/B on one machine says which way it goes (bench=serve_grounded's last row).
    carry_late_due: bool = False
    # Plain decode steps run back to back on the device when a step drafts nothing and every request
    # is greedy (engine/multi_step.py; vLLM's num_scheduler_steps): each step's argmax feeds the next
    # without a host read, and the host's per-step work is paid once per this many tokens. A request
    # then streams this many tokens at a time and a new one waits up to this many forwards for its
    # prefill (a run alone lasts about plain_decode_ms at most). The policy weighs the run against its
    # speculative plan (goodput: policies/run_cost.py). 1: off. Default 8, with decode_steps_max_batch
    # 1, since 2026-12-07 (H100, bench=serve_h200_verdict, two daemons a config): goodput with runs
    # alone +7.4 % per round against fixed k = 8 at N = 1 on chat prompts (its default then: -4.6 %),
    # -3.1 / +1.5 % at N = 4 / 64 (-2.6 / -1.9 %); on the grounded prompts at N = 1 -0.1 % (-1.4 %);
    # replayed on one daemon's costs +4.8 / +0.5 / +0.2 % over goodput without them (docs/benchmarks.md).
    decode_steps: int = 8
    # Runs of plain steps only while the decode batch has at most this many requests and none waits
    # for admission (null: at any batch). With 1, a request served alone streams its tokens in runs
    # (SmolLM2 non-speculative on the H200, 2026-12-06: 1,008 tok/s with runs of 8 at N = 1 against
    # 775 without), while a request that comes to a busy engine never waits for a run to end (TTFT p50
    # at N = 4 with runs of 8 at any batch: 6.7 ms against 4.0 without).
    decode_steps_max_batch: int | None = 1
    # Runs of this many plain steps for a decode batch of one request that cannot draft at all (its
    # proposer is none or its spec.max_k is 0) while none waits for admission, whatever decode_steps
    # says: nothing speculative is given up and no newcomer waits for the run. The non-speculative
    # server's batch-1 path: SmolLM2 on an H100 (2026-12-07 14:03, bench=serve_runs_alone_ab) 970 tok/s
    # against 648 one step at a time, TTFT p50 at N = 4 5.7 ms against 5.6. 1: off.
    plain_decode_steps: int = 8
    # ... and each such run lasts about this long at most: plain_decode_steps capped by this over the
    # measured ms of a plain forward alone (an EMA of the engine's own; before the first, one step), at
    # least 1: a newcomer waits for at most one run. SmolLM2 on an H100 (~0.96 ms a forward in a run)
    # runs 8; a 7B target (~7 ms a forward, a host share of a few %) runs one step at a time. null: no cap.
    plain_decode_ms: float | None = 8.0

    def __post_init__(self) -> None:
        if self.decide_cost not in ("exposed", "step", "host"):
            raise ValueError(f"scheduler.decide_cost must be exposed, step or host, got {self.decide_cost!r}")
        if self.decide_budget is not None and not self.decide_budget > 0:
            raise ValueError(f"scheduler.decide_budget must be > 0 or null, got {self.decide_budget}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue",
            "max_plan_age",
            "decode_steps",
            "plain_decode_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.max_joined_share <= 1.0:
            raise ValueError(f"scheduler.max_joined_share must be in [0, 1], got {self.max_joined_share}")
        if self.plan_ahead_max_batch is not None and self.plan_ahead_max_batch < 1:
            raise ValueError(
                f"scheduler.plan_ahead_max_batch must be >= 1 or null, got {self.plan_ahead_max_batch}"
            )
        if self.decode_steps_max_batch is not None and self.decode_steps_max_batch < 1:
            raise ValueError(
                f"scheduler.decode_steps_max_batch must be >= 1 or null, got {self.decode_steps_max_batch}"
            )
        if self.plain_decode_ms is not None and not self.plain_decode_ms > 0:
            raise ValueError(f"scheduler.plain_decode_ms must be > 0 or null, got {self.plain_decode_ms}")
        if self.plan_ahead not in ("auto", "on", "off"):
            raise ValueError(f"scheduler.plan_ahead must be auto, on or off, got {self.plan_ahead!r}")


@dataclass
class SpecConfig:
    """Speculation: the proposer, the scorers to build, the max k, and the policy that picks."""

    proposer: str = "ngram"  # none | ngram | draft | synthetic
    scorers: list[str] | None = None  # None = by device: scorers.registry.default_scorer_names
    max_k: int = 8
    ngram: NgramConfig = field(default_factory=NgramConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    synthetic_acceptance: float = 0.7  # for proposer=synthetic (benchmarks only)
    # proposer=synthetic: the oracle JSON ({"prompts": [[ids]], "outputs": [[ids]]}, bench/serve.py's
    # write_oracle); None = empty until set_oracle (in process). Ignored by the other proposers.
    synthetic_oracle: str | None = None
    # the cost models add each captured graph's residual to a graph scorer's score predictions
    # (policies/bucket_bias.py); False: the linear model alone (hydra: scorer.graph_residual)
    graph_residual: bool = True

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise ValueError(f"spec.max_k must be >= 0, got {self.max_k}")
        if self.scorers is not None and not self.scorers:
            raise ValueError("spec.scorers must name at least one scorer (or be null: by device)")
        if self.synthetic_oracle is not None and not str(self.synthetic_oracle).strip():
            raise ValueError(
                f"spec.synthetic_oracle must be a file path or null, got {self.synthetic_oracle!r}"
            )


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    policy: dict = field(default_factory=lambda: {"name": "fixed"})  # built by policies.registry
