"""The time of one training iteration of a :class:`~lightning_sp.planner.layout.Layout` on a
:class:`~lightning_sp.planner.cluster.Cluster`, from its parts (pure, no I/O).

Per transformer layer and micro-batch, on one rank (:mod:`lightning_sp.planner.ops` lists the
kernels, :mod:`lightning_sp.planner.kernels` times them):

* **compute**: the forward GEMMs; backward, a data- and a weight-gradient GEMM for each; with
  ``attention: sdpa`` the attention core is one fused kernel instead of two GEMMs and the
  softmax/dropout kernels;
* **memory-bound kernels**: LayerNorms, bias-dropout-adds, GeLU, softmax, attention dropout;
* **recompute** in backward: ``full`` replays the layer's forward (its TP collectives
  included); a module set replays, for each active module, the kernels tagged with it, the
  GEMMs scaled to the FLOPs the module's descriptor says it redoes
  (:data:`lightning_sp.model.recompute.RECOMPUTE_MODULES`);
* **tensor-parallel collectives** (Megatron's placement and overlap, plus what a part runs
  itself, exposed, each priced by its kind: :func:`lightning_sp.planner.ops.layer_collectives`):
  without SP, an all-reduce of the ``2sbh``-byte activation after the projection and after
  fc2 (exposed) and in backward before QKV and fc1 (overlapped with their weight-gradient
  GEMMs: only what outlasts the GEMM is exposed); with SP, an all-gather before QKV and fc1 and a
  reduce-scatter after the projection and fc2 (exposed), in backward the all-gathers of the
  gradient entering the projection and fc2 (exposed), the re-gather of QKV's and fc1's
  input (overlapped with the data-gradient GEMM) and the reduce-scatter of their input
  gradient (overlapped with the weight-gradient GEMM);
* **context parallelism** (``c > 1``, :mod:`lightning_sp.parallel.context_attention`): every
  kernel above runs on the rank's ``s/c`` tokens; the attention core is the CP core's, rank
  0's two chunks against their key prefixes (``(2c+1)·L²`` query-key pairs per head, ``L =
  s/(2c)``, dense masked blocks: :func:`lightning_sp.planner.ops.attention_pairs`), and its
  backward first replays its forward (whatever the recompute policy; ``core_attn`` does not
  act under CP). Its exchanges are what the code runs: forward one all-gather of this TP
  rank's K and V (``2·b·(g'/t)·s·d`` elements in all, GQA's KV heads only), backward one
  all-gather and one reduce-scatter of the same size, each over the CP group (NVLink when the
  ``t·c`` ranks of a TP x CP block share a node, else the network), none overlapped (the
  code calls them before and after the core, synchronously: no ring of per-chunk transfers to
  hide behind compute, as Megatron/TransformerEngine's ring would).
* **expert parallelism** (``e > 1``, a mixture-of-experts layer at balanced routing): each
  rank's ``E/e`` experts run as a batch of GEMMs of ``k·T/E·e`` rows each (``T`` the tokens a
  rank routes: ``s·b/c``, ``/t`` under SP) at the experts' weight shapes, their SwiGLU and
  the dispatch's and combine's row copies as memory-bound kernels
  (:meth:`~lightning_sp.model.moe.part.MoEFeedForward.memory_ops`); the dispatch and
  combine all-to-alls (forward, and their adjoints in backward; none overlapped) each send
  ``(e-1)/e`` of the rank's ``k·T`` rows, the shares for EP peers in the rank's node over
  NVLink and those for peers in other nodes over the network at once
  (:func:`expert_exchange_seconds`).

Per micro-batch and pipeline stage: its ``L/p`` layers, the embedding on the first stage and
the output layer + loss on the last, and ``2m`` point-to-point transfers of the
``2sbh/t``-byte boundary activation (one forward, one backward per model chunk; without SP
each receive is followed by an all-gather over the TP group, Megatron's scatter/gather
optimisation), not overlapped. Per iteration:

``n·T_max + (p-1)/m·T_mean`` (the slowest stage sets the pace of the steady state; the
pipeline fills and drains through the others: the bubble ``(p-1)/(m·n)`` of the paper;
``n`` is the micro-batches of one step on a rank, the pipeline schedule's or, at ``p = 1``,
Lightning's ``accumulate_grad_batches``, each a whole forward and backward, no bubble)
``+`` the step's one data-parallel gradient reduction, the part that outlasts the last
micro-batch's backward (all of it without ``overlap_grad_reduce``)
(fp32 gradients, summed over the ``d·c`` ranks of dp x cp, a mixture of experts' routed
experts (``1/e`` of them per rank) over the ``d·c/e`` ranks holding the same ones; all-reduce,
or with the distributed optimizer, which shards over those ranks, a reduce-scatter and an
exposed all-gather of the bf16 weights) ``+`` the
all-reduce of the tied embedding's gradient between the first and last stage ``+`` the
optimizer step (memory bound: the gradient norm reads 4 bytes per parameter and zeroing
writes 4; Adam reads the fp32 gradient, master, m and v and writes master, m, v and the bf16
weight, 30 bytes per parameter of its shard).

MFU and HFU are the paper's: model FLOPs (:func:`lightning_sp.memory.flops.
model_flops_per_iteration`) and hardware FLOPs (recomputation included, :func:`lightning_sp.
memory.flops.hardware_flops_per_iteration`) per second per GPU over the dense BF16 peak.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from lightning_sp.memory.flops import hardware_flops_per_iteration, model_flops_per_iteration
from lightning_sp.memory.model_state import expert_parameters_per_rank, parameters_per_rank
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.cores import ATTENTION_BACKENDS
from lightning_sp.model.recompute import (
    NO_RECOMPUTE,
    RECOMPUTE_MODULES,
    RecomputePolicy,
    active_modules,
)
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.kernels import (
    all_reduce_seconds,
    all_to_all_seconds,
    collective_seconds,
    flash_attention_seconds,
    gather_seconds,
    gemm_seconds,
    masked_attention_seconds,
    memory_seconds,
    transfer_seconds,
)
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.ops import (
    ACT,
    CP_CORE,
    Gemm,
    MemoryOp,
    attention_pairs,
    backward_gemms,
    embedding_memory_ops,
    head_gemms,
    head_memory_ops,
    layer_collectives,
    layer_gemms,
    layer_memory_ops,
)

GRAD_BYTES, OPTIMIZER_BYTES, UNSHARDED_STEP_BYTES = 4, 30, 8
"""fp32 gradient bytes per parameter reduced over data parallelism; bytes Adam moves per
parameter of its shard; bytes per parameter of the gradient norm and zeroing."""


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one transformer layer for one micro-batch on one rank."""

    forward: dict[str, float]
    """``gemm``, ``attention`` (the core: GEMMs + softmax/dropout, or the fused kernel),
    ``memory`` (the other memory-bound kernels), ``tp`` (exposed collectives), ``cp`` (the
    context-parallel K/V exchange, 0 without CP)."""

    backward: dict[str, float]
    """The same parts of backward (before any recompute)."""

    replays: dict[str, float] = field(default_factory=dict)
    """Recompute module -> seconds its replay adds to backward."""

    def recompute_seconds(self, policy: str | RecomputePolicy, attention: str) -> float:
        """What ``policy`` (a layer's, by :meth:`GPTConfig.layer_recompute`) adds to
        backward."""
        parsed = RecomputePolicy.parse(policy).check_resolved()
        if parsed.full:
            return sum(self.forward.values())
        return sum(self.replays[m.name] for m in active_modules(parsed.modules, attention))

    def seconds(self, policy: str | RecomputePolicy, attention: str) -> float:
        """Forward + backward + recompute under ``policy``."""
        return (
            sum(self.forward.values())
            + sum(self.backward.values())
            + self.recompute_seconds(policy, attention)
        )


_LAYER_TIMES: dict[tuple[str, int, int, Cluster, int, int, int], LayerTime] = {}
"""Memo of :func:`layer_time` by ``(repr(config without its recompute fields), t, b,
cluster, c, e, etp)``: a search asks for the same layer under many layouts."""


def layer_time(
    config: GPTConfig, t: int, b: int, cluster: Cluster, c: int = 1, e: int = 1, etp: int = 1
) -> LayerTime:
    """The parts of one layer of ``config`` (its ``sequence_parallel`` and ``attention``) at
    tensor-parallel size ``t``, micro-batch ``b``, context-parallel size ``c``,
    expert-parallel size ``e`` and expert tensor parallel size ``etp`` on ``cluster``
    (memoised; the recompute fields do not enter it)."""
    plain = dataclasses.replace(
        config, recompute=NO_RECOMPUTE, recompute_num_layers=None, recompute_rest=NO_RECOMPUTE
    )
    key = (repr(plain), t, b, cluster, c, e, etp)
    if key not in _LAYER_TIMES:
        if len(_LAYER_TIMES) > 4096:
            _LAYER_TIMES.clear()
        _LAYER_TIMES[key] = _layer_time(plain, t, b, cluster, c, e, etp)
    return _LAYER_TIMES[key]


def expert_exchange_seconds(
    config: GPTConfig, t: int, b: int, cluster: Cluster, c: int, e: int, etp: int = 1
) -> float:
    """One all-to-all of the ``k·s·b/(c·t)`` rows (SP) a rank dispatches to experts, at
    balanced routing, over the ``e`` ranks of its EP group: ``1/e`` of them stay, the shares
    of the other members of its node go over NVLink and those of members on other nodes over
    the network (the group is ``e`` ranks ``t`` apart:
    :meth:`~lightning_sp.planner.cluster.Cluster.members_in_node`;
    :func:`~lightning_sp.planner.kernels.all_to_all_seconds`); 0 for ``e = 1`` or a dense
    layer. The combine moves as many rows back."""
    shape = config.activation_shape(t, b, context_parallel_size=c, expert_tensor_parallel_size=etp)
    nbytes = config.block().dispatch_bytes(shape)
    if e == 1 or not nbytes:
        return 0.0
    return all_to_all_seconds(cluster, nbytes, e, cluster.members_in_node(t, e))


def cp_exchange_seconds(config: GPTConfig, t: int, b: int, cluster: Cluster, c: int) -> float:
    """One all-gather (or reduce-scatter) of this TP rank's K and V over the CP group: the
    gathered ``[2, b, g'/t, s, d]`` tensor, ``g' = max(g, t)``, over ``c`` ranks (NVLink when
    the ``t·c`` ranks of a TP x CP block share a node)."""
    kv_heads = max(config.groups, t) // t
    nbytes = ACT * 2 * b * kv_heads * config.seq_length * config.head_dim
    return gather_seconds(cluster, nbytes, c, cluster.within_node(t * c))


def _core_seconds(
    config: GPTConfig,
    cluster: Cluster,
    gemms: dict[str, Gemm],
    secs: tuple[dict[str, float], dict[str, float], dict[str, float]],
    core_memory: list[MemoryOp],
    c: int,
) -> tuple[float, float]:
    """``(forward, backward)`` of the attention core; under CP the backward includes the CP
    core's replay of its forward."""
    fwd_secs, dgrad, wgrad = secs
    core = [name for name, g in gemms.items() if g.tag in ("core_attn", CP_CORE)]
    if ATTENTION_BACKENDS[config.attention].keeps_scores:  # math: GEMMs, softmax / dropout
        forward = sum(fwd_secs[n] for n in core) + sum(
            memory_seconds(cluster, op.forward_bytes) for op in core_memory
        )
        backward = sum(dgrad[n] + wgrad[n] for n in core) + sum(
            memory_seconds(cluster, op.backward_bytes) for op in core_memory
        )
    elif c == 1:  # one fused kernel; its backward's own recomputation of QKᵀ is inside
        scores = gemms[core[0]]
        forward, backward = flash_attention_seconds(cluster, scores.m, scores.k, scores.batch)
    else:  # the CP chunks: fused kernels under a mask, every pair computed
        scores = gemms[core[0]]
        pairs = attention_pairs(config.seq_length, c)
        forward, backward = masked_attention_seconds(cluster, pairs, scores.k, scores.batch)
    return forward, backward + (forward if c > 1 else 0.0)


def _layer_time(
    config: GPTConfig, t: int, b: int, cluster: Cluster, c: int, e: int = 1, etp: int = 1
) -> LayerTime:
    sp = config.sequence_parallel
    gemms = {g.name: g for g in layer_gemms(config, t, b, c, e, etp)}
    grads = {name: backward_gemms(g) for name, g in gemms.items()}
    secs = {name: gemm_seconds(cluster, g) for name, g in gemms.items()}
    dgrad = {name: gemm_seconds(cluster, d) for name, (d, _) in grads.items()}
    wgrad = {name: gemm_seconds(cluster, w) for name, (_, w) in grads.items()}
    core_tags = ("core_attn", CP_CORE)
    core = [name for name, g in gemms.items() if g.tag in core_tags]
    ops = layer_memory_ops(config, t, b, sp, c)
    core_memory = [op for op in ops if op.tag in core_tags]
    attn_fwd, attn_bwd = _core_seconds(config, cluster, gemms, (secs, dgrad, wgrad), core_memory, c)
    others = [op for op in ops if op.tag not in core_tags]
    dense = [name for name in gemms if name not in core]
    unit = gather_seconds(
        cluster,
        ACT * config.seq_length // c * b * config.hidden_size,
        t,
        cluster.within_node(t),
    )
    exchange = cp_exchange_seconds(config, t, b, cluster, c) if c > 1 else 0.0
    experts = expert_exchange_seconds(config, t, b, cluster, c, e, etp)
    # the input linears of attention and of the MLP (fc1, or SwiGLU's gate and up run as one)
    inputs = config.block().input_gemms()
    in_dgrad = [sum(dgrad[n] for n in names) for names in inputs]
    in_wgrad = [sum(wgrad[n] for n in names) for names in inputs]
    if sp:  # all-gather before qkv/fc1, reduce-scatter after projection/fc2
        tp_fwd = 4 * unit
        tp_bwd = 2 * unit + sum(
            max(0.0, unit - dg) + max(0.0, unit - wg)
            for dg, wg in zip(in_dgrad, in_wgrad, strict=True)
        )
    else:  # all-reduce after projection/fc2; backward's before qkv/fc1 overlap wgrad
        tp_fwd = 4 * unit
        tp_bwd = sum(max(0.0, 2 * unit - wg) for wg in in_wgrad)
    for col in layer_collectives(config, t, b, c, etp):  # a part's own (exposed)
        one = collective_seconds(cluster, col, t, cluster.within_node(t))
        tp_fwd, tp_bwd = tp_fwd + col.forward * one, tp_bwd + col.backward * one
    forward = {
        "gemm": sum(secs[n] for n in dense),
        "attention": attn_fwd,
        "memory": sum(memory_seconds(cluster, op.forward_bytes) for op in others),
        "tp": tp_fwd,
        "cp": exchange,
        "ep": 2 * experts,  # dispatch and combine
    }
    backward = {
        "gemm": sum(dgrad[n] + wgrad[n] for n in dense),
        "attention": attn_bwd,
        "memory": sum(memory_seconds(cluster, op.backward_bytes) for op in others),
        "tp": tp_bwd,
        "cp": 2 * exchange,  # the all-gather again and the reduce-scatter of dK/dV
        "ep": 2 * experts,  # the combine's and the dispatch's adjoints
    }
    return LayerTime(forward, backward, _replays(config, t, b, cluster, gemms, secs, ops, c))


def _replays(
    config: GPTConfig,
    t: int,
    b: int,
    cluster: Cluster,
    gemms: dict[str, Gemm],
    secs: dict[str, float],
    ops: list[MemoryOp],
    c: int = 1,
) -> dict[str, float]:
    """Seconds each recompute module's replay takes: its tagged memory kernels, and its tagged
    GEMMs scaled to the FLOPs its descriptor redoes (per rank: ``/(t·c)``). Under CP
    ``core_attn`` replays nothing (the model leaves the CP core, which replays itself, alone)."""
    shape = config.activation_shape(t, b, context_parallel_size=c)
    replays = {}
    for name, module in RECOMPUTE_MODULES.items():
        if c > 1 and module.needs_scores:
            replays[name] = 0.0
            continue
        tagged = [n for n, g in gemms.items() if g.tag == name]
        flops = sum(gemms[n].flops for n in tagged)
        redone = module.redone_flops(shape) / (t * c)
        if redone and not flops:
            raise ValueError(f"recompute module {name} redoes FLOPs but tags no GEMM")
        seconds = sum(secs[n] for n in tagged) * (redone / flops) if flops else 0.0
        seconds += sum(memory_seconds(cluster, op.replayed) for op in ops if op.tag == name)
        replays[name] = seconds
    return replays


def data_parallel_exposed(
    layout: Layout,
    reduce: float,
    layer: LayerTime,
    policies: Counter[RecomputePolicy],
    attention: str,
) -> float:
    """The part of the step's one gradient reduction (``reduce`` seconds) left exposed: with
    ``overlap_grad_reduce`` the buckets launch during the backward of the step's last
    micro-batch (the earlier ones, accumulated by the pipeline schedule or by Lightning, only
    add into the buffer), so what outlasts one micro-batch's backward of the stage's layers;
    without, all of it."""
    if not layout.overlap_grad_reduce:
        return reduce
    last_backward = layout.virtual_pipeline_size * sum(
        k * (sum(layer.backward.values()) + layer.recompute_seconds(pol, attention))
        for pol, k in policies.items()
    )
    return max(0.0, reduce - last_backward)


@dataclass(frozen=True)
class StepTime:
    """The predicted iteration and its parts (seconds unless named otherwise)."""

    iteration_seconds: float
    tokens_per_second: float
    model_tflops_per_gpu: float
    mfu: float
    """Model FLOPs per second per GPU / peak (the paper's MFU)."""
    hfu: float
    """Hardware FLOPs (recomputation included) per second per GPU / peak."""
    parts: dict[str, float]
    """``pipeline`` (``n·T_max + bubble``), ``bubble``, ``p2p`` (per iteration on the
    slowest stage), ``layer_forward``, ``layer_backward``, ``layer_recompute``, ``tp``,
    ``cp`` and ``ep`` (the experts' all-to-alls) (per iteration, one stage's layers),
    ``dp_exposed``, ``embedding_grad``, ``optimizer``."""
    layer: LayerTime
    """The parts of one layer for one micro-batch."""


def step_time(layout: Layout, cluster: Cluster, config: GPTConfig | None = None) -> StepTime:
    """The iteration time of ``layout`` on ``cluster``; ``config`` (default
    ``layout.config``) fixes the row's ``sequence_parallel`` and recompute policy (no
    ``auto``)."""
    cfg = layout.config if config is None else config
    t, p, m = (
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        layout.virtual_pipeline_size,
    )
    # n: micro-batches per step on one rank, the pipeline's or Lightning's accumulation's
    n, b, d = layout.microbatches_per_step, layout.micro_batch_size, layout.data_parallel_size
    c = layout.context_parallel_size
    sp, s, h = cfg.sequence_parallel, cfg.seq_length // c, cfg.hidden_size  # s: this rank's
    layer = layer_time(
        cfg, t, b, cluster, c, layout.expert_parallel_size, layout.expert_tensor_parallel_size
    )
    chunk = layout.layers_per_chunk
    policies = Counter(cfg.layer_recompute(i) for i in range(chunk))
    per_chunk = sum(k * layer.seconds(policy, cfg.attention) for policy, k in policies.items())
    layers = m * per_chunk
    within_tp = cluster.within_node(t)
    unit = gather_seconds(cluster, ACT * s * b * h, t, within_tp)
    # embedding (first stage) and output layer + loss (last stage)
    emb = (
        sum(
            memory_seconds(cluster, op.forward_bytes + op.backward_bytes)
            for op in embedding_memory_ops(cfg, t, b, sp, c)
        )
        + 2 * unit
    )  # SP: reduce-scatter forward, all-gather backward; else an all-reduce forward
    logits = head_gemms(cfg, t, b, c)[0]
    dgrad, wgrad = (gemm_seconds(cluster, g) for g in backward_gemms(logits))
    head = gemm_seconds(cluster, logits) + dgrad + wgrad
    head += sum(
        memory_seconds(cluster, op.forward_bytes + op.backward_bytes)
        for op in head_memory_ops(cfg, t, b, sp, c)
    )
    head += (unit + max(0.0, unit - wgrad)) if sp else max(0.0, 2 * unit - wgrad)
    # pipeline
    p2p = 0.0
    if p > 1:
        in_node = t * c * d * p <= cluster.gpus_per_node
        one = transfer_seconds(cluster, ACT * s * b * h / t, in_node)
        if not sp:
            one += unit  # scatter/gather: the receiving TP group all-gathers the message
        p2p = 2 * m * one
    if p == 1:
        slowest = mean = layers + emb + head
    else:
        slowest = max(layers + emb, layers + head) + p2p
        mean = layers + p2p + (emb + head) / p
    bubble = (p - 1) / m * mean
    pipeline = n * slowest + bubble
    # data parallelism, tied embedding, optimizer
    e = layout.expert_parallel_size
    params = parameters_per_rank(cfg, t, p, e)
    experts = expert_parameters_per_rank(cfg, t, p, e)  # over the d·c/e ranks holding them
    groups = ((params - experts, d * c), (experts, d * c // e))  # (parameters, ranks)
    dp_exposed = 0.0
    if d * c > 1:  # gradients summed over dp x cp (the ranks of one TP / PP position)
        in_node = t * c * d <= cluster.gpus_per_node
        reduce = gather = 0.0
        for count, ranks in groups:
            if layout.distributed_optimizer:  # sharded over those ranks
                reduce += gather_seconds(cluster, GRAD_BYTES * count, ranks, in_node)
                gather += gather_seconds(cluster, ACT * count, ranks, in_node)
            else:
                reduce += all_reduce_seconds(cluster, GRAD_BYTES * count, ranks, in_node)
        dp_exposed = data_parallel_exposed(layout, reduce, layer, policies, cfg.attention) + gather
    embedding_grad = 0.0
    if p > 1:
        vocab = cfg.padded_vocab_size(t) // t * h
        in_node = t * c * d * p <= cluster.gpus_per_node
        embedding_grad = all_reduce_seconds(cluster, GRAD_BYTES * vocab, 2, in_node)
    shard = sum(n / r for n, r in groups) if layout.distributed_optimizer else params
    optimizer = memory_seconds(cluster, UNSHARDED_STEP_BYTES * params + OPTIMIZER_BYTES * shard)
    iteration = pipeline + dp_exposed + embedding_grad + optimizer
    # the paper's metrics
    batch, gpus = layout.global_batch_size, layout.world_size
    model = model_flops_per_iteration(cfg, batch)
    part = dataclasses.replace(cfg, num_layers=chunk)  # the recompute pattern repeats per chunk
    redone = hardware_flops_per_iteration(part, batch, chunk, context_parallel_size=c)
    hardware = model + cfg.num_layers // chunk * (redone - model_flops_per_iteration(part, batch))
    per_gpu = 1.0 / (iteration * gpus)
    recompute = m * sum(k * layer.recompute_seconds(p, cfg.attention) for p, k in policies.items())
    parts = {
        "pipeline": pipeline,
        "bubble": bubble,
        "p2p": n * p2p,
        "layer_forward": n * m * chunk * sum(layer.forward.values()),
        "layer_backward": n * m * chunk * sum(layer.backward.values()),
        "layer_recompute": n * recompute,
        "tp": n * m * chunk * (layer.forward["tp"] + layer.backward["tp"]),
        "cp": n * m * chunk * (layer.forward["cp"] + layer.backward["cp"]),
        "ep": n * m * chunk * (layer.forward["ep"] + layer.backward["ep"]),
        "dp_exposed": dp_exposed,
        "embedding_grad": embedding_grad,
        "optimizer": optimizer,
    }
    return StepTime(
        iteration_seconds=iteration,
        tokens_per_second=batch * cfg.seq_length / iteration,
        model_tflops_per_gpu=model * per_gpu / 1e12,
        mfu=model * per_gpu / cluster.peak_flops,
        hfu=hardware * per_gpu / cluster.peak_flops,
        parts=parts,
        layer=layer,
    )
