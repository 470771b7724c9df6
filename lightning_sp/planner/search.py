"""``estimate --search``: every layout of the same GPUs and global batch, ranked by predicted
iteration time among those whose most loaded rank fits the device (pure, no I/O).

The dimensions: tensor-parallel size t, pipeline size p, model chunks m (interleaving), data
parallelism d (= GPUs / (t·p·c)), micro-batch b (micro-batches n = global batch / (d·b):
the pipeline schedule's ``num_microbatches`` at p > 1, Lightning's ``accumulate_grad_batches``
at p = 1, where ``fit`` refuses ``num_microbatches > 1``),
recompute policy, sequence parallelism and the distributed optimizer, and the
context-parallel size c (:data:`CONTEXT_PARALLEL_SIZES`, where ``2c`` divides the sequence:
causal load balancing). Memory is the formulas' (:func:`lightning_sp.planner.
estimate.estimate` with ``measure=False``), the time :mod:`lightning_sp.planner.steptime`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, replace

from lightning_sp.errors import ConfigError, divisors
from lightning_sp.model.lora import LoRAConfig
from lightning_sp.model.recompute import NO_RECOMPUTE
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.planner.cluster import Cluster
from lightning_sp.planner.estimate import estimate
from lightning_sp.planner.layout import Layout, runs
from lightning_sp.planner.lora import lora_note, lora_row
from lightning_sp.planner.records import EstimateRow

CONTEXT_PARALLEL_SIZES: tuple[int, ...] = (1, 2, 4, 8)
"""Context-parallel sizes searched (c divides the GPUs with t·p·d and ``2c`` the sequence);
Megatron-Core and NeMo recipes use these (one node's worth at most with t = 1)."""

VIRTUAL_PIPELINE_SIZES: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
"""Model chunks per pipeline rank tried (where the layers divide into p·m chunks)."""

MAX_MICRO_BATCH = 16
"""The largest micro-batch tried."""


Key = tuple[int, int, int, int, int, bool, str, bool, int, int]
"""``(t, p, m, c, b, sp, recompute, distributed_optimizer, e)`` of a searched layout."""


@dataclass(frozen=True)
class Candidate:
    """One searched layout and its estimate row."""

    layout: Layout
    """The layout (its config has the row's sequence parallelism and recompute policy)."""
    context_parallel_size: int
    """c."""
    row: EstimateRow
    """Memory and predicted time."""

    def key(self) -> Key:
        """``(t, p, m, c, b, sp, recompute, distributed_optimizer, e, etp)``."""
        x = self.layout
        return (
            x.tensor_parallel_size, x.pipeline_parallel_size, x.virtual_pipeline_size,
            self.context_parallel_size, x.micro_batch_size, self.row.sequence_parallel,
            self.row.recompute, x.distributed_optimizer, x.expert_parallel_size,
            x.expert_tensor_parallel_size,
        )  # fmt: skip


@dataclass
class SearchResult:
    """The ranked layouts that fit, and what was searched."""

    base: Layout
    cluster: Cluster
    device_bytes: float
    ranked: list[Candidate]
    """Layouts that fit, fastest first."""
    layouts: int
    """Layouts (t, p, m, c, b, distributed optimizer) estimated."""
    rows: int
    """Rows (x SP x recompute) estimated."""
    seconds: float
    lora: LoRAConfig | None = None
    """A LoRA run's adapters: every row priced as :func:`~lightning_sp.planner.lora.lora_row`
    prices it (a frozen base)."""

    def rank_of(self, key: Key) -> int | None:
        """1-based rank of the candidate with :meth:`Candidate.key` ``key`` (``None``: it did
        not fit or was not searched)."""
        for i, candidate in enumerate(self.ranked, 1):
            if candidate.key() == key:
                return i
        return None


def base_key(layout: Layout) -> Key:
    """The :meth:`Candidate.key` of the configured layout (``auto`` stays ``auto``)."""
    return (
        layout.tensor_parallel_size, layout.pipeline_parallel_size,
        layout.virtual_pipeline_size, layout.context_parallel_size, layout.micro_batch_size,
        layout.config.sequence_parallel,
        layout.recompute.name, layout.distributed_optimizer,
        layout.expert_parallel_size, layout.expert_tensor_parallel_size,
    )  # fmt: skip


def _layouts(base: Layout, max_micro_batch: int) -> list[tuple[Layout, int]]:
    """Every valid ``(layout, c)`` of ``base``'s GPUs and global batch."""
    gpus, batch, cfg = base.world_size, base.global_batch_size, base.config
    config = dataclasses.replace(cfg, recompute=NO_RECOMPUTE, recompute_num_layers=None)
    out = []
    for c in CONTEXT_PARALLEL_SIZES:
        two_c = ParallelConfig(context_parallel_size=c).sequence_divisor(False)  # causal balance
        if gpus % c or cfg.seq_length % two_c:
            continue
        for t in divisors(gpus // c):
            # sequence parallelism is a row of the estimate, checked there: t is searched if
            # either setting can run (an MoE model at t > 1 needs SP)
            tc = ParallelConfig(tensor_parallel_size=t, context_parallel_size=c)
            if not any(runs(replace(config, sequence_parallel=sp), tc) for sp in (False, True)):
                continue
            for p in divisors(gpus // (c * t)):
                d = gpus // (c * t * p)
                if cfg.num_layers % p or batch % d:
                    continue
                for b in divisors(batch // d):
                    n = batch // (d * b)
                    if b > max_micro_batch or (p > 1 and n < p):
                        continue
                    # p = 1 splits a step by Lightning's accumulation, p > 1 by the schedule
                    n_pipe, k = (n, 1) if p > 1 else (1, n)
                    for m in VIRTUAL_PIPELINE_SIZES:
                        if m > 1 and (p == 1 or cfg.num_layers % (p * m) or n % p):
                            continue
                        for zero, e, etp in itertools.product(
                            (False, True) if d * c > 1 else (False,),
                            config.expert_parallel_sizes(d * c),
                            config.expert_tensor_parallel_sizes(t),
                        ):
                            layout = Layout(
                                config=config, tensor_parallel_size=t,
                                pipeline_parallel_size=p, virtual_pipeline_size=m,
                                num_microbatches=n_pipe, accumulate_grad_batches=k,
                                micro_batch_size=b, data_parallel_size=d,
                                context_parallel_size=c, distributed_optimizer=zero,
                                overlap_grad_reduce=base.overlap_grad_reduce,
                                expert_parallel_size=e, expert_tensor_parallel_size=etp,
                                source=base.source,
                                document_mask=base.document_mask,
                                reset_position_ids=base.reset_position_ids,
                            )  # fmt: skip
                            out.append((layout, c))
    return out


def search(
    base: Layout,
    cluster: Cluster,
    device_bytes: float,
    max_micro_batch: int = MAX_MICRO_BATCH,
    lora: LoRAConfig | None = None,
) -> SearchResult:
    """Estimate every layout of ``base``'s GPU count and global batch (``base``'s model),
    keep the rows that fit ``device_bytes``, fastest first (sequence parallelism only where
    t > 1); with ``lora``, each row priced as that LoRA run (:func:`~lightning_sp.planner.
    lora.lora_row`: frozen base, the adapters' activations and GEMMs)."""
    start = time.perf_counter()
    ranked, rows, layouts = [], 0, _layouts(base, max_micro_batch)
    for layout, c in layouts:
        try:
            result = estimate(layout, device_bytes, measure=False, cluster=cluster)
        except ConfigError:
            continue
        for row in result.rows:
            if row.sequence_parallel and layout.tensor_parallel_size == 1:
                continue
            rows += 1
            chosen = dataclasses.replace(
                layout, config=layout.with_policy(row.sequence_parallel, row.recompute)
            )
            if lora is not None:
                row = lora_row(row, chosen, lora, cluster)
            if row.fits:
                ranked.append(Candidate(chosen, c, row))
    ranked.sort(key=lambda x: x.row.iteration_seconds)
    seconds = time.perf_counter() - start
    return SearchResult(base, cluster, device_bytes, ranked, len(layouts), rows, seconds, lora)


def format_search(result: SearchResult, top: int) -> str:
    """The ranked table: the ``top`` fastest layouts that fit, and where the configured one
    ranks."""
    base, cfg = result.base, result.base.config
    lines = [
        f"{base.source}: search over {base.world_size} GPUs ({result.cluster.name}), global "
        f"batch {base.global_batch_size}, s={cfg.seq_length} h={cfg.hidden_size} "
        f"L={cfg.num_layers} a={cfg.num_heads} attention={cfg.attention}; "
        f"{result.layouts} layouts x SP x recompute = {result.rows} rows estimated, "
        f"{len(result.ranked)} fit {result.device_bytes / 1e9:.0f} GB "
        f"({result.seconds:.1f} s)",
        "",
        f"{'rank':>4} {'t':>3} {'p':>3} {'m':>2} {'c':>2} {'d':>4} {'e':>3} {'etp':>3} {'b':>3} "
        f"{'n':>5} "
        f"{'acc':>4} "
        f"{'SP':<3} "
        f"{'recompute':<9} {'dist-opt':<8} {'memory GB':>9} {'step s':>8} {'tokens/s':>10} "
        f"{'MFU':>6} {'HFU':>6} {'vs 1st':>7}",
    ]
    if result.lora is not None:
        lines.insert(1, lora_note(result.lora))
    key = base_key(base)
    first = result.ranked[0].row.iteration_seconds if result.ranked else 1.0
    for i, x in enumerate(result.ranked[:top], 1):
        lay, row = x.layout, x.row
        mark = " *" if x.key() == key else ""
        lines.append(
            f"{i:>4} {lay.tensor_parallel_size:>3} {lay.pipeline_parallel_size:>3} "
            f"{lay.virtual_pipeline_size:>2} {x.context_parallel_size:>2} "
            f"{lay.data_parallel_size:>4} {lay.expert_parallel_size:>3} "
            f"{lay.expert_tensor_parallel_size:>3} "
            f"{lay.micro_batch_size:>3} {lay.num_microbatches:>5} "
            f"{lay.accumulate_grad_batches:>4} "
            f"{'on' if row.sequence_parallel else 'off':<3} {row.recompute:<9} "
            f"{'yes' if lay.distributed_optimizer else 'no':<8} "
            f"{row.total_bytes / 1e9:>9.2f} {row.iteration_seconds:>8.3f} "
            f"{row.tokens_per_second:>10.0f} {row.mfu:>6.1%} {row.hfu:>6.1%} "
            f"{row.iteration_seconds / first - 1:>+7.1%}{mark}"
        )
    rank = result.rank_of(key)
    where = f"rank {rank}" if rank is not None else "does not fit (or is not a searched layout)"
    if len(result.ranked) > 1:
        shown = result.ranked[: max(2, top)]
        second, last = (x.row.iteration_seconds / first - 1 for x in (shown[1], shown[-1]))
        lines.append(
            f"(vs 1st: the predicted step over the first's; the first two are {second:.1%} "
            f"apart, the first {len(shown)} within {last:.1%}: a margin below the model's error "
            "on published runs, docs/planner.md, is no predicted win)"
        )
    lines.append(
        f"(* the configured layout: t={key[0]} p={key[1]} m={key[2]} c={key[3]} b={key[4]} "
        f"e={key[8]} SP {'on' if key[5] else 'off'} {key[6]}: {where})"
    )
    return "\n".join(lines)
