"""One row of a planner estimate: a ``(sequence_parallel, recompute)`` combination of a
:class:`~lightning_sp.planner.layout.Layout`, its activation bytes by the paper's formulas
(:func:`formula_activations`, with what packed documents add) and measured under fake tensors
(:func:`measure_combination`), the first pipeline stage's bytes (eq. 5, interleaving, §4.5:
:func:`first_stage_bytes`) and its predicted step time (:func:`estimate_row`). Pure, no I/O;
:mod:`lightning_sp.planner.estimate` assembles the rows.
"""

from __future__ import annotations

import dataclasses

from lightning_sp.memory.fake import ActivationMeasurement, measure_activations
from lightning_sp.memory.formulas import (
    activation_bytes_per_layer,
    chunk_forwards_in_flight,
    embedding_activation_bytes,
    output_activation_bytes,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.documents import packed_bytes
from lightning_sp.model.spec import POSITIONS
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.layout import Layout
from lightning_sp.planner.records import Activations, EstimateRow
from lightning_sp.planner.steptime import step_time


def formula_activations(layout: Layout, config: GPTConfig) -> Activations:
    """The paper's bytes (Table 2 generalised, §4.5) for ``config`` laid out as ``layout``,
    with what packed documents add (the attention part's terms under a document mask, the
    ids, positions and per-token RoPE tables: :func:`~lightning_sp.model.documents.
    packed_bytes`)."""
    shape = layout.shape_of(config)
    packed = packed_bytes(
        shape,
        document_mask=layout.document_mask,
        reset_position_ids=layout.reset_position_ids,
        rotary=not POSITIONS[config.position_embedding].learned,
    )
    return Activations(
        per_layer=activation_bytes_per_layer(shape, config.recompute),
        embedding=embedding_activation_bytes(shape),
        head=output_activation_bytes(shape, config.padded_vocab_size(layout.tensor_parallel_size)),
        ids=packed.ids,
        tables=packed.tables,
    )


def document_mask_bytes_per_layer(layout: Layout, config: GPTConfig) -> float:
    """What the document mask adds to a layer's saved bytes under ``config.recompute`` (the
    formula's difference; the fake-tensor trace runs causal, since ``sdpa``'s per-document
    calls need the document lengths on the host, which fake tensors do not have)."""
    if not layout.document_mask:
        return 0.0
    masked, causal = (
        activation_bytes_per_layer(
            dataclasses.replace(layout.shape_of(config), documents=documents), config.recompute
        )
        for documents in (True, False)
    )
    return masked - causal


def measure_combination(layout: Layout, config: GPTConfig, layers: int) -> ActivationMeasurement:
    return measure_activations(
        config,
        layout,
        micro_batch_size=layout.micro_batch_size,
        layers=min(layers, config.num_layers),
        head=layout.pipeline_parallel_size == 1,
    )


def optimizer_shards(layout: Layout) -> int:
    """Ranks the distributed optimizer splits the fp32 masters and Adam moments over: the
    ``d·c`` ranks of dp x cp (``ParallelState.gradient_group``, as Megatron-Core)."""
    return layout.data_parallel_size * layout.context_parallel_size


def first_stage_bytes(layout: Layout, layer_bytes: list[float], acts: Activations) -> float:
    """Activation bytes of the first stage: ``layer_bytes`` (one model chunk's layers, in
    order) × the chunk forwards in flight (= per layer × eq. 5 × interleaving), the embedding
    per micro-batch in flight (§4.5), and the head if the first stage is also the last."""
    p, n = layout.pipeline_parallel_size, layout.num_microbatches
    in_flight = chunk_forwards_in_flight(p, layout.virtual_pipeline_size, n)
    total = sum(layer_bytes) * in_flight + acts.embedding * min(p, n)
    total += acts.ids * n + acts.tables * in_flight  # packed documents (0 without)
    return total + (acts.head if p == 1 else 0.0)


def estimate_row(
    layout: Layout,
    sequence_parallel: bool,
    recompute: str,
    by_policy: dict[str, tuple[Activations, Activations]],
    state_bytes: int,
    device_bytes: int,
    cluster: Cluster,
    recompute_num_layers: int | None = None,
    recompute_rest: str | None = None,
) -> EstimateRow:
    """One row from ``by_policy[policy] = (got, formula)`` activations of this SP setting; the
    layers of a chunk run what :meth:`GPTConfig.layer_recompute` says they run (with
    ``recompute_num_layers``, the others run ``recompute_rest``; ``None``: as configured)."""
    config = layout.with_policy(sequence_parallel, recompute, recompute_num_layers, recompute_rest)
    policies = [config.layer_recompute(i).name for i in range(layout.layers_per_chunk)]
    sums = []
    for which in (0, 1):  # got (measured, or the formula when not measured), formula
        layers = [by_policy[policy][which].per_layer for policy in policies]
        first = first_stage_bytes(layout, layers, by_policy[recompute][which])
        sums.append((sum(layers) / len(layers), first))
    (got, got_first), (formula, formula_first) = sums
    time = step_time(layout, cluster, config)
    return EstimateRow(
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        activation_bytes_per_layer=round(got),
        formula_bytes_per_layer=round(formula),
        first_stage_activation_bytes=round(got_first),
        formula_first_stage_activation_bytes=round(formula_first),
        model_state_bytes=state_bytes,
        total_bytes=round(got_first) + state_bytes,
        device_bytes=device_bytes,
        recompute_num_layers=recompute_num_layers,
        recompute_rest=None if recompute_num_layers is None else policies[-1],
        iteration_seconds=time.iteration_seconds,
        tokens_per_second=time.tokens_per_second,
        model_tflops_per_gpu=time.model_tflops_per_gpu,
        mfu=time.mfu,
        model_tflops_per_gpu_causal_half=time.model_tflops_per_gpu_causal_half,
        mfu_causal_half=time.mfu_causal_half,
        hfu=time.hfu,
    )
