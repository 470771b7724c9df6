"""``lightning-sp calibrate``: measure the step-time model's kernels on this device and write a
cluster YAML that ``estimate --cluster`` reads (:mod:`lightning_sp.planner.calibrate`)."""

from __future__ import annotations

import os

import torch
import yaml

from lightning_sp.cli.parser import OneLineArgumentParser, positive
from lightning_sp.model.config import GPTConfig
from lightning_sp.planner.calibrate import SMOKE_CONFIG, calibrate
from lightning_sp.planner.presets import PRESETS, load_cluster

DESCRIPTION = "Calibrate the step-time model on the device at hand (writes a cluster YAML)."


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """``lightning-sp calibrate``; returns the exit status."""
    parser = OneLineArgumentParser("calibrate", description=DESCRIPTION)
    parser.add_argument("--config", help="a fit config whose model.config is measured")
    parser.add_argument("--base", default="a100-80gb", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensor_parallel_sizes", default="1,2,4,8")
    parser.add_argument("--micro_batch_sizes", default="1,2,4")
    parser.add_argument("--seconds", type=positive(float), default=0.2, help="time per kernel")
    parser.add_argument("--out", default="benchmarks/results/cluster.yaml")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, seconds on a CPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.smoke:
        config = SMOKE_CONFIG
        tps, mbs, seconds, square, copy_bytes = [1, 2], [1], 0.002, 256, 1 << 22
    else:
        if args.config is None:
            parser.error("--config is required (or --smoke)")
        with open(args.config) as fh:
            config = GPTConfig.from_values(yaml.safe_load(fh)["model"]["config"])
        tps, mbs = _sizes(args.tensor_parallel_sizes), _sizes(args.micro_batch_sizes)
        tps = [t for t in tps if config.num_heads % t == 0 and config.ffn_size % t == 0]
        seconds, square, copy_bytes = args.seconds, 8192, 1 << 30
    result = calibrate(config, PRESETS[args.base], device, tps, mbs, seconds, square, copy_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        yaml.safe_dump(result, fh, sort_keys=False)
    cluster = load_cluster(args.out)  # what estimate --cluster will read
    print(
        f"{cluster.calibration.device}: {len(cluster.calibration.kernels)} kernels measured; "
        f"best GEMM {cluster.gemm_flops / 1e12:.3g} TFLOP/s ({cluster.gemm_efficiency:.1%} of "
        f"{cluster.peak_flops / 1e12:.4g}), copy {cluster.memory_rate / 1e9:.4g} GB/s "
        f"({cluster.hbm_efficiency:.1%}), attention dropout x"
        f"{cluster.flash_attention_dropout_cost:.3f}; wrote {args.out} "
        f"(lightning-sp estimate ... --cluster {args.out})"
    )
    return 0
