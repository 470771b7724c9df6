"""A LoRA training step against a full fine-tuning step of the same model, and against ``peft`` +
transformers on the same model and adapters: ``python -m benchmarks.lora`` (``--smoke``: a
seconds-long plumbing run).

One process, one intra-op thread, fp32, a Llama (RMSNorm, RoPE, SwiGLU, grouped-query
attention) saved by transformers and read by ours (``init_from``'s reader), r = 8 adapters on
every linear, ``B`` non-zero, the same values on both sides. A step is forward, backward and
AdamW (``torch.optim.AdamW`` on the trainable parameters: ours through
:func:`~lightning_sp.optim.adamw.build_adamw`, which holds the adapters only):

Our GPT runs the ``sdpa`` attention backend, as transformers' model does.

* ``lora``: our GPT with :func:`~lightning_sp.model.lora.apply_lora` (the base frozen: no
  weight-gradient GEMM, no gradient, no optimizer state for it);
* ``full``: our GPT, every weight trained;
* ``peft``: transformers' ``LlamaForCausalLM`` (SDPA attention) under ``peft.get_peft_model``
  with the same settings, its loss the cross-entropy of its logits.

Before any timing, ``lora``'s and ``peft``'s losses must agree to fp32 tolerance (checked).
Every round runs each step once, in an order rotated round by round; the ratios are medians
of the per-round ratios with 95% bootstrap intervals (:mod:`benchmarks._stats`), over the
rounds where other processes took under :data:`benchmarks._cpu.CLEAN_SHARE` of the machine
when at least half are, else all (``clean`` says which). Peak memory: each variant in a fresh
process (spawned), a few steps, its peak resident set (``VmHWM``) and that peak less the
resident set before the model was built (the import's).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import _cpu
from benchmarks._fit import batch
from benchmarks._format import ci, fixed, parser, save, stamp, table
from benchmarks._stats import clean_rounds, interleaved, medians, ratios_over
from lightning_sp.interop.hf import load_hf_weights, read_hf_config
from lightning_sp.interop.hf_types import model_type_for
from lightning_sp.interop.peft import hf_modules, peft_name
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, lora_parameters
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.state import ParallelState

VARIANTS = ("lora", "full", "peft")
LOSS_RTOL = 1e-5
"""fp32 agreement of ours and peft's loss (relative)."""


@dataclasses.dataclass(frozen=True)
class LoRAShape:
    """The model, the batch and the rounds measured."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    batch: int
    r: int
    rounds: int
    warmup: int
    memory_steps: int


FULL = LoRAShape(hidden_size=256, num_layers=4, num_heads=8, num_query_groups=2,
                 ffn_hidden_size=704, vocab_size=4096, seq_length=128, batch=4, r=8,
                 rounds=15, warmup=2, memory_steps=3)  # fmt: skip
SMOKE = LoRAShape(hidden_size=32, num_layers=1, num_heads=4, num_query_groups=2,
                  ffn_hidden_size=64, vocab_size=128, seq_length=16, batch=2, r=4,
                  rounds=2, warmup=1, memory_steps=1)  # fmt: skip


def save_base(shape: LoRAShape, directory: Path) -> None:
    """A seeded random transformers Llama of ``shape`` saved in ``directory``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_query_groups,
        max_position_embeddings=shape.seq_length, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def _adapter_values(shape: LoRAShape, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Seeded adapter values (``B`` non-zero) by our global names, from our adapted model."""
    generator = torch.Generator().manual_seed(1)
    return {
        model.global_name(n): torch.randn(p.shape, generator=generator) * 0.05  # type: ignore[operator]
        for n, p in lora_parameters(model).items()
    }


def build(shape: LoRAShape, base: Path, variant: str) -> tuple[Any, torch.optim.Optimizer, Any]:
    """``(model, optimizer, step)`` of one variant; ``step(ids, labels)`` runs forward, backward
    and the optimizer step and returns the loss."""
    config = read_hf_config(base, seq_length=shape.seq_length, hidden_dropout=0.0,
                            attention_dropout=0.0, attention="sdpa")  # fmt: skip
    lora = LoRAConfig(r=shape.r, lora_alpha=2.0 * shape.r, target_modules=["all-linear"])
    ours = GPT(config, ParallelState.single(), dtype=torch.float32)
    load_hf_weights(ours, base)
    apply_lora(ours, lora)
    values = _adapter_values(shape, ours)
    if variant == "peft":
        import peft
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa")
        settings = peft.LoraConfig(
            r=lora.r, lora_alpha=int(lora.lora_alpha),
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"],
        )  # fmt: skip
        model = peft.get_peft_model(hf, settings).float().train()
        theirs = dict(model.named_parameters())
        modules = hf_modules(model_type_for(config), config)
        with torch.no_grad():
            for name, value in values.items():
                linear, _, which = name.rpartition(".lora.")
                key = peft_name(linear, which, modules).replace(".weight", ".default.weight")
                theirs[key].copy_(value)
        trainable = [p for p in model.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)

        def peft_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits = model(ids).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            return loss.detach()

        return model, adamw, peft_step
    if variant == "full":
        ours = GPT(config, ParallelState.single(), dtype=torch.float32)
        load_hf_weights(ours, base)
    else:
        with torch.no_grad():
            for name, param in lora_parameters(ours).items():
                param.copy_(values[ours.global_name(name)])
    ours.train()
    optimizer = build_adamw(ours, 1e-4, 0.0, (0.9, 0.999), 1e-8)

    def our_step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = ours(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return ours, optimizer, our_step


def _peak_memory(shape: LoRAShape, base: str, variant: str, queue: Any) -> None:
    """In a fresh process: ``memory_steps`` steps of ``variant``; puts ``(peak RSS, peak less
    the RSS before building)`` in MiB on ``queue``."""
    torch.set_num_threads(1)
    import peft  # noqa: F401  (imported before the baseline, as transformers by the reader)
    import transformers  # noqa: F401

    before = _cpu.rss_kib("VmRSS")
    _, _, step = build(shape, Path(base), variant)
    ids, labels = batch(shape.vocab_size, shape.batch, shape.seq_length, seed=2)
    for _ in range(shape.memory_steps):
        step(ids, labels)
    peak = _cpu.rss_kib("VmHWM")
    queue.put((peak / 1024, (peak - before) / 1024))


def peak_memory(shape: LoRAShape, base: Path) -> dict[str, dict[str, float]]:
    """Each variant's peak resident set in its own spawned process (MiB)."""
    context = multiprocessing.get_context("spawn")
    out = {}
    for variant in VARIANTS:
        queue = context.Queue()
        process = context.Process(target=_peak_memory, args=(shape, str(base), variant, queue))
        process.start()
        peak, grown = queue.get(timeout=600)
        process.join()
        out[variant] = {"peak_rss_mib": peak, "peak_over_start_mib": grown}
    return out


def measure(shape: LoRAShape) -> dict[str, Any]:
    """Seconds per step of each variant (every round), the per-round ratios with 95% intervals,
    and each variant's peak memory."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        save_base(shape, base)
        steps = {v: build(shape, base, v)[2] for v in VARIANTS}
        ids, labels = batch(shape.vocab_size, shape.batch, shape.seq_length, seed=2)
        first = {v: steps[v](ids, labels).item() for v in ("lora", "peft")}
        error = abs(first["lora"] - first["peft"]) / abs(first["peft"])
        assert error <= LOSS_RTOL, f"lora and peft disagree: losses {first} ({error:.2e})"
        shares: list[float] = []
        steps_ = {v: functools.partial(steps[v], ids, labels) for v in VARIANTS}
        seconds = interleaved(steps_, shape.warmup, shape.rounds, rotate=True, shares=shares)
        del steps, steps_
        memory = peak_memory(shape, base)
    used, rounds = clean_rounds(shares)
    return {
        "shape": dataclasses.asdict(shape),
        "threads": torch.get_num_threads(),
        "loss_relative_error_vs_peft": error,
        **rounds,
        "ms_per_step": medians(seconds, used, 1e3),
        "ratios": ratios_over(seconds, "lora", ("full", "peft"), used),
        "memory": memory,
        "samples": seconds,
    }


def markdown(result: dict[str, Any]) -> str:
    """One table: ms per step, our LoRA step over each with its interval, peak memory."""
    labels = {
        "lora": "ours: LoRA r=8, all linears (base frozen)",
        "full": "ours: full fine-tune",
        "peft": "peft + transformers LoRA r=8, all linears",
    }
    rows = [
        [
            labels[v],
            fixed(result["ms_per_step"][v], 1),
            "" if v == "lora" else ci(result["ratios"][f"lora_over_{v}"]),
            fixed(result["memory"][v]["peak_rss_mib"], 0),
            fixed(result["memory"][v]["peak_over_start_mib"], 0),
        ]
        for v in VARIANTS
    ]
    header = ["step (fwd + bwd + AdamW)", "ms / step", "ours LoRA / it [95% CI]",
              "peak RSS MiB", "peak over start MiB"]  # fmt: skip
    return table(header, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    meta = stamp()
    result = measure(SMOKE if args.smoke else FULL)
    save(args, argv, "lora", result, markdown(result), **meta)
    return result


if __name__ == "__main__":
    main()
