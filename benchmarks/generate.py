"""Generation speed: tokens/s with the key/value cache against a full forward every token.

    python -m benchmarks.generate            # 4-layer h=256 GPT, 64-token prompt, 128 new tokens
    python -m benchmarks.generate --smoke    # tiny shapes, seconds

One process, fp32, greedy decoding of the same prompt both ways (the tokens must be equal,
which is checked). The two modes alternate for ``--repeats`` rounds and the ratio of their
median tokens/s is reported with a bootstrap confidence interval: a ratio within one run, as
everything in ``benchmarks/``. Without the cache step ``i`` recomputes all ``n + i``
positions, so the ratio grows with the generated length.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from benchmarks._fit import gpt_config
from benchmarks._format import ci, fixed, parser, save, table
from benchmarks._stats import interleaved, median_ci, ratio_of_medians_ci
from lightning_sp import GPT, ParallelState
from lightning_sp.model.generate import GenerationConfig, generate


@dataclasses.dataclass(frozen=True)
class GenerateShape:
    """The model and the generation measured."""

    hidden_size: int
    num_layers: int
    num_heads: int
    prompt_tokens: int
    new_tokens: int
    repeats: int


FULL = GenerateShape(hidden_size=256, num_layers=4, num_heads=8, prompt_tokens=64,
                     new_tokens=128, repeats=5)  # fmt: skip
SMOKE = GenerateShape(hidden_size=32, num_layers=2, num_heads=4, prompt_tokens=8,
                      new_tokens=16, repeats=2)  # fmt: skip


def measure(shape: GenerateShape) -> dict[str, Any]:
    """tokens/s of each mode (every sample), and the cached / uncached ratio."""
    s = shape.prompt_tokens + shape.new_tokens
    config = gpt_config(257, s, shape.hidden_size, shape.num_layers, shape.num_heads,
                        "selective", 0.0, init_std=0.5)  # fmt: skip
    model = GPT(config, ParallelState.single(), dtype=torch.float32)
    prompt = torch.randint(
        0, 256, (shape.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    )
    outputs: dict[str, list[int]] = {}

    def run(mode: str) -> None:
        settings = GenerationConfig(max_new_tokens=shape.new_tokens, temperature=0.0,
                                    use_cache=mode == "cache")  # fmt: skip
        outputs[mode] = generate(model, prompt.tolist(), settings)

    steps = {mode: functools.partial(run, mode) for mode in ("cache", "no_cache")}
    seconds = interleaved(steps, 0, shape.repeats)
    rates = {mode: [len(outputs[mode]) / t for t in values] for mode, values in seconds.items()}
    if outputs["cache"] != outputs["no_cache"]:
        raise AssertionError("the cached and uncached greedy tokens differ")
    ratio, low, high = ratio_of_medians_ci(rates["cache"], rates["no_cache"])
    return {
        "shape": dataclasses.asdict(shape),
        "tokens_per_sec": {mode: median_ci(values)[0] for mode, values in rates.items()},
        "samples": rates,
        "cache_speedup": {"ratio": ratio, "low": low, "high": high},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    result = measure(SMOKE if args.smoke else FULL)
    rates, x = result["tokens_per_sec"], result["cache_speedup"]
    rows = [
        ["tokens/s, key/value cache", fixed(rates["cache"], 1)],
        ["tokens/s, full forward per token", fixed(rates["no_cache"], 1)],
        ["cache / full forward [95% CI]", ci([x["ratio"], x["low"], x["high"]], 2)],
    ]
    save(args, argv, "generate", result, table(["measure", "value"], rows))
    return result


if __name__ == "__main__":
    main()
