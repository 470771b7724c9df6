"""The mixture-of-experts feed-forward part (``GPTConfig.feed_forward = "moe"``): the module is
:class:`lightning_sp.model.moe.layer.MoE`; here its saved bytes, GEMMs, memory-bound kernels (the
experts' activation, the dispatch and combine row copies), parameters (total and active) and
FLOPs (active), at balanced routing (each expert receives ``k·T/E`` of the ``T`` tokens'
assignments; dropless).

Every routed tensor is per token of the rank's own tokens (``s·b/c``, divided by t under the
sequence parallelism MoE requires at ``t > 1``), so every routed term sits :data:`OUTSIDE` the
TP region; expert parallelism moves rows between ranks but, balanced, a rank computes as many
rows as it sends (``k·T_local``): EP divides the expert *weights*, not these bytes. The shared
experts are a tensor-parallel MLP (:data:`INSIDE` terms).

Bytes per MoE layer for ``T = s·b`` tokens, ``e`` bytes per activation, ``r`` bytes per router
element (4 for fp32), 8 bytes per int64 index, ``N = k·T`` rows:

* ``moe_input`` ``e·Th``: the router's input (the layer's normalised input);
* ``router_probs`` ``r·TE``: the softmax (or sigmoid) output; with ``normalize_top_k`` the
  ``k`` chosen probabilities and their sum, ``r·T(k + 1)``; the chosen experts ``8·Tk``;
* ``routed_indices``: the dispatch's token and slot indices ``16·N`` (plus ``16·N`` for the
  regroup and its inverse under EP, ``e_p > 1``);
* ``expert_input`` ``e·Nh`` (rows sent to experts: the grouped gate/up GEMM's input);
  ``expert_act_input`` ``2e·N·f_e`` (SwiGLU's ``[gate | up]``); ``expert_down_input``
  ``e·N·f_e``; ``combine`` ``e·Nh + e·N`` (expert outputs and their weights);
* z-loss (``z_loss_coef > 0``): the logits ``r·TE`` and their ``logsumexp`` ``r·T``;
* shared experts: ``2e·T·f_s`` (``[gate | up]``) and ``e·T·f_s`` (inside: divided by t).

Under expert tensor parallelism (``etp = t``, SP on) each rank still routes its own sequence
shard and dispatches its rows over EP; the TP group then all-gathers the rows its ranks
received, so each TP rank runs its ``f_e/t`` slice on the group's ``N = k·T`` rows (``T =
sb/c``). Only ``expert_input`` (those gathered rows, the gate/up GEMM's input) is
:data:`REPLICATED`, the experts' ``f_e`` terms are :data:`INSIDE` (``N·f_e/t`` per rank) and
every other term stays :data:`OUTSIDE`, as at ``etp = 1`` (the row exchanges regroup with
``split``/``cat`` and save nothing). Per rank, bf16, router fp32, ``N = kT``: ``2Th/t +
4TE/t + 4T(k+1)/t + 8Tk/t + 16N(1 + [e_p > 1])/t + 2Nh + 6N·f_e/t + (2Nh + 2N)/t`` (+ z-loss
``(4TE + 4T)/t``, + shared ``6T·f_s/t``): ``etp = 1``'s bytes plus ``2Nh(1 - 1/t)``, the
gathered rows.

Left out, as the norms' statistics are: the load-balancing loss's per-expert counts, ``r·E``
bytes per layer (not per token). Measured (bf16, saved-tensor hooks, forced-balanced routing)
these terms are exact to the byte at t = 1, 2 (SP) and e = 1, 2, 4
(``tests/test_moe_memory.py``). Expert parallelism does not divide them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import TOTALS, MoE
from lightning_sp.model.moe.metrics import routing_metrics
from lightning_sp.model.parts.base import (
    EVERY_RANK,
    INSIDE,
    OUTSIDE,
    REPLICATED,
    Collective,
    CollectiveKind,
    Gemm,
    MemoryOp,
    Part,
    PartLinear,
    StepTotals,
    Terms,
    activation_op,
    float8_scale,
    tokens,
)
from lightning_sp.model.parts.build import BuildContext
from lightning_sp.model.parts.weights import (
    ExpertWeightMap,
    HFNames,
    Weight,
    WeightMap,
    convention,
    join,
)
from lightning_sp.model.shape import ActivationShape

INDEX = 8
"""Bytes of an int64 index element."""


@dataclass(frozen=True)
class ExpertNames:
    """A family's names of the MoE part's tensors under a layer: the router's module, the
    experts' module (expert ``e`` under ``<experts>.<e>``) and each expert's gate, up and down
    projections."""

    router: str
    experts: str
    gate: str
    up: str
    down: str
    in_memory: str = "mlp"
    """The module transformers 5 holds the block as in memory: router ``<in_memory>.gate``,
    fused experts ``<in_memory>.experts.gate_up_proj [E, 2f_e, h]`` (gate then up) and
    ``.down_proj [E, h, f_e]``."""


HF_MOE: dict[str, ExpertNames] = {
    "mixtral": ExpertNames("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "llama": ExpertNames("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
}
"""The MoE part's Hugging Face names by convention: Mixtral's, and the Llama-style MoE families'
(Qwen3-MoE, OLMoE)."""


@dataclass(frozen=True)
class MoEFeedForward(Part):
    """The MoE layer of ``config`` (see the module docstring); the expert-parallel size is the
    shape's ``x.e`` (its module reads the layout's)."""

    config: MoEConfig

    def build(self, ctx: BuildContext) -> nn.Module:
        return MoE(ctx, self.config)

    def step_totals(self) -> StepTotals:
        """Each layer's routing sums (:data:`~lightning_sp.model.moe.layer.TOTALS`, then the
        choices per expert) and the step's ``moe/*`` metrics made of them
        (:func:`~lightning_sp.model.moe.metrics.routing_metrics`)."""
        return StepTotals(len(TOTALS) + self.config.num_experts, routing_metrics)

    def router_bytes(self, x: ActivationShape) -> float:
        """Bytes per router element: fp32 4, fp64 8, else the activations'."""
        return {"fp32": 4.0, "fp64": 8.0}.get(self.config.router_dtype, x.activation_bytes)

    def saved_terms(self, x: ActivationShape) -> Terms:
        cfg, e, r = self.config, x.activation_bytes, self.router_bytes(x)
        t = x.s * x.b  # tokens of the whole layer before any split
        k, n, f = cfg.top_k, cfg.top_k * x.s * x.b, cfg.expert_ffn_size
        chosen = r * t * (k + 1) if cfg.normalize_top_k else 0.0
        indices = 2 * INDEX * n * (2 if x.e > 1 else 1)  # EP: the regroup and its inverse
        # expert TP: each TP rank runs its f_e/t slice on the TP group's gathered rows
        gathered, inner = (REPLICATED, INSIDE) if x.etp > 1 else (OUTSIDE, OUTSIDE)
        terms: Terms = {
            "moe_input": (e * t * x.h, OUTSIDE),
            "router_probs": (r * t * cfg.num_experts + chosen + INDEX * t * k, OUTSIDE),
            "routed_indices": (float(indices), OUTSIDE),
            "expert_input": (e * n * x.h, gathered),
            "expert_act_input": (2 * e * n * f, inner),
            "expert_down_input": (e * n * f, inner),
            "combine": (e * n * x.h + e * n, OUTSIDE),
        }
        if cfg.z_loss_coef:
            terms["router_z_loss"] = (r * t * cfg.num_experts + r * t, OUTSIDE)
        if cfg.num_shared_experts:
            terms["shared_act_input"] = (2 * e * t * cfg.shared_ffn_size, INSIDE)
            terms["shared_down_input"] = (e * t * cfg.shared_ffn_size, INSIDE)
        return terms

    def float8_terms(self, x: ActivationShape, terms: Terms, kept: set[str]) -> Terms:
        """Under an FP8 recipe that keeps its forward casts (``tensorwise``): each routed
        expert is its own float8 linear (:mod:`lightning_sp.parallel.fp8_grouped`), so
        ``expert_input`` ``N·h`` and ``expert_down_input`` ``N·f_e`` keep 1 byte an element
        and each a ``[E/e]`` fp32 scale per local expert (``4E/e`` bytes on every rank; the
        ``mlp_act`` module drops the down input's with it); the shared experts are dense
        float8 linears: ``shared_down_input`` ``T·f_s`` and its scale, and their gate/up keep
        the float8 cast of the layer's input, ``shared_input`` ``T·h`` and a scale, a term
        of its own, since the router keeps that input in high precision (``moe_input``
        unchanged). Everything else (router, SwiGLU's input, indices, combine) is as in
        high precision."""
        e, local = x.activation_bytes, self.config.num_experts // x.e
        out = super().float8_terms(x, terms, kept & {"shared_down_input"})
        for name in ("expert_input", "expert_down_input"):
            nbytes, region = out[name]
            out[name] = (nbytes / e, region)
            out[float8_scale(name)] = (4.0 * local, EVERY_RANK)
        if self.config.num_shared_experts:
            out["shared_input"] = (float(x.s * x.b * x.h), OUTSIDE)
            out[float8_scale("shared_input")] = (4.0, EVERY_RANK)
        return out

    def gemms(self, x: ActivationShape) -> list[Gemm]:
        """Router ``T_local x h -> E`` (``T_local`` the tokens of the rank's own sequence
        shard); the experts' grouped GEMMs at their per-expert shapes (at balance each of the
        rank's ``E/e`` experts gets ``k·T_local/E`` rows from each of the ``x.e`` ranks of its
        EP group, and under expert tensor parallelism from each of the ``t`` ranks of its TP
        group: a batch of ``E/e`` GEMMs of ``k·T_local·e·etp/E`` rows, ``f_e/etp`` wide); the
        shared experts' TP-split GEMMs over the gathered tokens. Under ``fp8`` all but the
        router run in float8 (each expert its own float8 linear: the batch's GEMMs)."""
        cfg, h = self.config, x.h
        mine = tokens(x) // (x.t if x.sequence_parallel else 1)  # tokens this rank routes
        local, f = cfg.num_experts // x.e, cfg.expert_ffn_size // x.etp
        rows = -(-cfg.top_k * mine * x.e * x.etp // cfg.num_experts)  # per expert (fullest's)
        gemms = [
            Gemm("router", mine, cfg.num_experts, h, high_precision=True),  # never float8
            Gemm("expert_gate_up", rows, 2 * f, h, batch=local, routed=True),
            Gemm("expert_down", rows, h, f, batch=local, routed=True),
        ]
        if cfg.num_shared_experts:
            fs = cfg.shared_ffn_size // x.t
            gemms += [
                Gemm("shared_gate_up", tokens(x), 2 * fs, h),
                Gemm("shared_down", tokens(x), h, fs),
            ]
        return gemms

    def input_gemms(self) -> tuple[str, ...]:
        return ("shared_gate_up",) if self.config.num_shared_experts else ()

    def linears(self, x: ActivationShape) -> tuple[PartLinear, ...]:
        """Its linears, none of which takes a LoRA adapter: frozen with the base, the router
        and the shared experts' input projections keep no ``moe_input``, the experts no
        ``expert_input`` nor ``expert_down_input``, the shared experts' down projection no
        ``shared_down_input`` (what stays: the activations' inputs, the router's outputs,
        the indices and the combine)."""
        cfg, h, f = self.config, x.h, self.config.expert_ffn_size
        rows = [
            PartLinear("router", "column", h, cfg.num_experts, "moe_input"),
            PartLinear("experts.gate_up", "column", h, 2 * f, "expert_input"),
            PartLinear("experts.down", "row", f, h, "expert_down_input"),
        ]
        if cfg.num_shared_experts:
            fs = cfg.shared_ffn_size
            rows.append(PartLinear("shared.fc2", "row", fs, h, "shared_down_input"))
        return tuple(rows)

    def memory_ops(self, x: ActivationShape) -> list[MemoryOp]:
        """The layer's memory-bound kernels on one rank at balance, ``N = k·T_local`` rows
        of ``h`` (``T_local`` the tokens the rank routes, as in :meth:`gemms`; ``a`` bytes
        per activation, ``R = a·N·h`` the bytes of the ``[N, h]`` rows):

        * ``expert_act``: the experts' SwiGLU on the ``etp·N`` rows the rank computes, ``f_e
          /etp`` wide, the fused activation's 4 / 6 bytes per element of its ``[gate | up]``
          read (:func:`~lightning_sp.model.parts.base.activation_op`, tagged ``mlp_act``,
          which the experts replay); the shared experts' the same on ``T x f_s`` (``/t``);
        * ``expert_dispatch``: the row gathers of :func:`lightning_sp.parallel.dispatch.
          dispatch`, read + write ``2R`` each: the expert-sorted copy of the tokens, and
          under EP (``e > 1``) the regroup of the received rows by local expert; under expert
          tensor parallelism the regroup of the TP group's gathered rows (``2·etp·R``,
          :func:`~lightning_sp.parallel.expert_rows.gather_rows`);
        * ``expert_combine``: :func:`~lightning_sp.parallel.dispatch.combine`'s gathers
          (under EP the inverse regroup, then each (token, slot)'s row, ``2R`` each), the
          rows scaled by their weights (read and write ``R``) and summed over the ``k``
          slots (read ``R``, write ``a·T_local·h``); under expert tensor parallelism the
          regroup of the partial sums before their reduce-scatter (``2·etp·R``).

        Backward moves as many bytes as forward in each (the gathers' adjoints scatter-add
        the same rows; the weighted sum's reads the gradient and the rows; each TP regroup's
        adjoint is the other's). The router's softmax and top-k on ``T_local x E`` fp32
        scores are left out, as the norms' statistics are (``E = 8``, ``T_local = 4096``:
        0.1 MB against the rows' 67 MB)."""
        cfg, a = self.config, x.activation_bytes
        mine = tokens(x) // (x.t if x.sequence_parallel else 1)  # tokens this rank routes
        n = cfg.top_k * mine  # rows it dispatches
        rows = a * n * x.h  # [N, h]
        passes = 2 if x.e > 1 else 1  # EP: the regroup by local expert and its inverse
        regroup = 2 * rows * x.etp if x.etp > 1 else 0  # expert TP: the gathered rows' regroup
        dispatch = 2 * rows * passes + regroup
        combine = 2 * rows * passes + 3 * rows + a * mine * x.h + regroup
        ops = [
            replace(
                activation_op("expert_act", n * x.etp * cfg.expert_ffn_size, 2, x.etp),
                routed=True,
            ),
            MemoryOp("expert_dispatch", dispatch, dispatch, routed=True),
            MemoryOp("expert_combine", combine, combine, routed=True),
        ]
        if cfg.num_shared_experts:
            ops.append(activation_op("shared_act", tokens(x) * cfg.shared_ffn_size, 2, x.t))
        return ops

    def parameters(self, x: ActivationShape) -> tuple[int, int]:
        """``(split, replicated)`` at ``e = 1``: the shared experts split over TP; router and
        all ``E`` experts replicated (a rank of an EP group of ``e`` holds ``E/e`` of them:
        :meth:`expert_parameters`, divided by e in
        :func:`~lightning_sp.memory.model_state.stage_parameter_count`)."""
        cfg, h = self.config, x.h
        return 3 * h * cfg.shared_ffn_size, cfg.num_experts * h + self.expert_parameters(x)

    def expert_parameters(self, x: ActivationShape) -> int:
        """Parameters of all ``E`` routed experts on one TP rank (``3·h·f_e`` each, ``/t``
        under expert tensor parallelism)."""
        return self.config.num_experts * 3 * x.h * self.config.expert_ffn_size // x.etp

    def active_expert_parameters(self, x: ActivationShape) -> int:
        """The ``k`` routed experts one token uses (``3·h·f_e`` each)."""
        return self.config.top_k * 3 * x.h * self.config.expert_ffn_size

    def dispatch_bytes(self, x: ActivationShape) -> float:
        """The ``k`` rows of each of the rank's ``s·b/c`` tokens (``/t`` under SP: every rank
        routes its own sequence shard, under expert tensor parallelism too), ``e·h`` bytes
        each: what a dispatch sends, the share for other EP ranks being ``(e-1)/e``."""
        mine = tokens(x) / (x.t if x.sequence_parallel else 1)
        return x.activation_bytes * self.config.top_k * mine * x.h

    def collectives(self, x: ActivationShape) -> list[Collective]:
        """Under expert tensor parallelism: the all-gather of the dispatched rows over the TP
        group before the experts and the reduce-scatter of their partial sums after them
        (once each per forward and per backward), each of the group's ``k·s·b/c`` rows at
        balance (``k·s·b/(c·t)`` from each TP rank), ``a·h`` bytes a row; else none."""
        if x.etp == 1:
            return []
        nbytes = float(x.activation_bytes * self.config.top_k * tokens(x) * x.h)  # [kT, h]
        return [
            Collective("expert_tp_gather", CollectiveKind.ALL_GATHER, nbytes, 1, 1),
            Collective("expert_tp_scatter", CollectiveKind.REDUCE_SCATTER, nbytes, 1, 1),
        ]

    def weights(self, names: HFNames) -> tuple[Weight, ...]:
        """The router and the stacked experts: ``experts.gate_up [E, 2f_e, h]`` held per
        expert by the gate's then the up projection's tensor, ``experts.down [E, h, f_e]`` by
        the down projection's, or each by one fused tensor in transformers' in-memory form
        (the shared experts have no Hugging Face names)."""
        hf = convention(HF_MOE, names.feed_forward, "MoE")
        expert, router = join(hf.experts, "{e}"), join(hf.router, "weight")
        fused = join(hf.in_memory, "experts")
        in_memory = join(hf.in_memory, "gate", "weight")
        return (
            WeightMap("router.weight", router, in_memory="" if in_memory == router else in_memory),
            ExpertWeightMap(
                "experts.gate_up",
                (join(expert, hf.gate, "weight"), join(expert, hf.up, "weight")),
                join(fused, "gate_up_proj"),
            ),
            ExpertWeightMap(
                "experts.down", (join(expert, hf.down, "weight"),), join(fused, "down_proj")
            ),
        )

    def forward_flops(self, x: ActivationShape) -> float:
        """Active matmul FLOPs: router ``2·T·h·E``, ``k`` SwiGLU experts ``6·T·h·f_e`` each,
        the shared experts ``6·T·h·f_s`` (``T = b·s``)."""
        cfg, t = self.config, x.b * x.s
        return (
            2.0
            * t
            * x.h
            * (cfg.num_experts + 3 * cfg.top_k * cfg.expert_ffn_size + 3 * cfg.shared_ffn_size)
        )
