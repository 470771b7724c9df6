"""``lightning-sp step-check``: the step-time model's prediction beside the measured forward +
backward of a one-device layout, per recompute policy (:mod:`lightning_sp.planner.step_check`)."""

from __future__ import annotations

import json

import torch
import yaml

from lightning_sp.cli.parser import OneLineArgumentParser, positive
from lightning_sp.model.config import GPTConfig
from lightning_sp.planner.calibrate import SMOKE_CONFIG
from lightning_sp.planner.presets import load_cluster
from lightning_sp.planner.step_check import check

DESCRIPTION = "Predicted against measured step time on the device at hand."


def main(argv: list[str] | None = None) -> int:
    """``lightning-sp step-check``; returns the exit status."""
    parser = OneLineArgumentParser("step-check", description=DESCRIPTION)
    parser.add_argument("--config", help="a fit config whose model.config is run")
    parser.add_argument("--cluster", default="a100-80gb", help="a preset or a cluster YAML")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--micro_batch_size", type=positive(int), default=None,
        help="sequences per forward (default: the config's data.batch_size, else 1)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=positive(float), default=1.0, help="time per measurement")
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, seconds on a CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        config, seconds, batch = SMOKE_CONFIG, 0.05, 1
    else:
        if args.config is None:
            parser.error("--config is required (or --smoke)")
        with open(args.config) as fh:
            values = yaml.safe_load(fh)
        config = GPTConfig.from_values(values["model"]["config"])
        seconds, batch = args.seconds, (values.get("data") or {}).get("batch_size", 1)
    micro_batch = batch if args.micro_batch_size is None else args.micro_batch_size
    cluster = load_cluster(args.cluster)
    device = torch.device(args.device)
    rows = check(config, micro_batch, cluster, device, seconds)
    for row in rows:
        print(
            f"{row['recompute']:10} predicted {1e3 * row['predicted_seconds']:9.3f} ms  "
            f"measured {1e3 * row['measured_seconds']:9.3f} ms  "
            f"measured / predicted {row['ratio']:.3f}"
        )
    print(f"({device}, cluster {cluster.name}, b={micro_batch}, t=p=d=1)")
    if args.out:
        with open(args.out, "w") as fh:
            found = {
                "device": str(device),
                "cluster": cluster.name,
                "micro_batch_size": micro_batch,
            }
            json.dump({**found, "rows": rows}, fh)
    return 0
