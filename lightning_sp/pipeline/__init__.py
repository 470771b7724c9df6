"""Pipeline parallelism (paper §4.4): model chunks per stage and torch's 1F1B / interleaved
schedules, with TP+SP inside every stage."""

from lightning_sp.pipeline.split import (
    check_batch,
    check_pipeline,
    check_pipeline_schedule,
    chunk_layer_ranges,
)
from lightning_sp.pipeline.stages import Pipeline

__all__ = [
    "Pipeline",
    "check_batch",
    "check_pipeline",
    "check_pipeline_schedule",
    "chunk_layer_ranges",
]
