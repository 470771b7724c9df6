"""FLOPs formulas (paper Appendix A) against hand arithmetic, the paper's numbers and a real
forward + backward counted by ``torch.utils.flop_counter.FlopCounterMode``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_sp import GPT, ConfigError, GPTConfig, ParallelState
from lightning_sp.memory.flops import (
    forward_flops_per_iteration,
    hardware_flops_per_iteration,
    measure_peak_flops,
    model_flops_per_iteration,
    peak_flops,
)

GPT3_175B = GPTConfig(
    vocab_size=51200, seq_length=2048, hidden_size=12288, num_layers=96, num_heads=96
)
MT_NLG_530B = GPTConfig(
    vocab_size=51200, seq_length=2048, hidden_size=20480, num_layers=105, num_heads=128
)


def _paper_model_flops(c: GPTConfig, batch: int) -> float:
    s, h, L, v = c.seq_length, c.hidden_size, c.num_layers, c.vocab_size
    return 72 * batch * s * L * h**2 * (1 + s / (6 * h) + v / (12 * h * L))


def _paper_full_recompute_flops(c: GPTConfig, batch: int) -> float:
    s, h, L, v = c.seq_length, c.hidden_size, c.num_layers, c.vocab_size
    return 96 * batch * s * L * h**2 * (1 + s / (6 * h) + v / (16 * h * L))


def test_hand_computed_small_case() -> None:
    # B=2, s=8, h=4, f=16, L=3, v=10
    c = GPTConfig(vocab_size=10, seq_length=8, hidden_size=4, num_layers=3, num_heads=2)
    layer_forward = 8 * 2 * 8 * 16 + 4 * 2 * 8 * 4 * 16 + 4 * 2 * 64 * 4  # 2048+4096+2048
    logits = 2 * 2 * 8 * 4 * 10  # 1280
    assert layer_forward == 8192
    assert logits == 1280
    forward = 3 * layer_forward + logits  # 25856
    assert forward_flops_per_iteration(c, 2) == forward
    assert model_flops_per_iteration(c, 2) == 3 * forward == 77568
    assert model_flops_per_iteration(c, 2) == pytest.approx(_paper_model_flops(c, 2), rel=1e-12)
    # lean redoes no more matmuls than selective (LayerNorm, GeLU and masks are not matmuls)
    recompute = {"none": 0, "selective": 3 * 4 * 2 * 64 * 4, "lean": 3 * 4 * 2 * 64 * 4,
                 "full": 3 * 8192, "layernorm+mlp_act": 0}  # fmt: skip
    for policy, extra in recompute.items():
        cfg = dataclasses.replace(c, recompute=policy)
        assert hardware_flops_per_iteration(cfg, 2) == 77568 + extra, policy
    # sdpa: the fused backward recomputes QKᵀ (2Bs²h per layer); core_attn does not act
    qk = 3 * 2 * 2 * 64 * 4
    for policy, extra in {"none": qk, "selective": qk, "lean": qk, "full": qk + 3 * 8192}.items():
        cfg = dataclasses.replace(c, recompute=policy, attention="sdpa")
        assert hardware_flops_per_iteration(cfg, 2) == 77568 + extra, policy
        assert model_flops_per_iteration(cfg, 2) == 77568  # model FLOPs know no backend
    full = dataclasses.replace(c, recompute="full")
    assert hardware_flops_per_iteration(full, 2) == pytest.approx(
        _paper_full_recompute_flops(full, 2), rel=1e-12
    )
    # full on the first layer, recompute_rest on the other two: one layer forward + the rest's
    core = 4 * 2 * 64 * 4  # QKᵀ and probs·V of one layer
    for rest, extra in {"none": 0, "selective": 2 * core, "lean": 2 * core, "mlp_act": 0}.items():
        cfg = dataclasses.replace(full, recompute_num_layers=1, recompute_rest=rest)
        assert hardware_flops_per_iteration(cfg, 2) == 77568 + 8192 + extra, rest
    # recompute_num_layers counts per model chunk: 4 layers in 2 chunks (p·m = 2), full on the
    # first layer of each, none on the others: two layers' forwards again
    four = dataclasses.replace(full, num_layers=4, recompute_num_layers=1, recompute_rest="none")
    model = model_flops_per_iteration(four, 2)
    assert hardware_flops_per_iteration(four, 2, layers_per_chunk=2) == model + 2 * 8192
    assert hardware_flops_per_iteration(four, 2) == model + 8192  # one chunk of 4


@pytest.mark.parametrize("config", [GPT3_175B, MT_NLG_530B], ids=["175B", "530B"])
def test_large_models_match_paper_formulas(config: GPTConfig) -> None:
    batch = 1536
    assert model_flops_per_iteration(config, batch) == pytest.approx(
        _paper_model_flops(config, batch), rel=1e-12
    )
    full = dataclasses.replace(config, recompute="full")
    assert hardware_flops_per_iteration(full, batch) == pytest.approx(
        _paper_full_recompute_flops(full, batch), rel=1e-12
    )
    # full recompute adds one forward of every layer: close to 4/3 for large h
    ratio = hardware_flops_per_iteration(full, batch) / model_flops_per_iteration(config, batch)
    assert ratio == pytest.approx(4 / 3, abs=0.005)
    assert ratio < 4 / 3  # the logits are not recomputed


@pytest.mark.parametrize(
    ("config", "paper_percent", "of_model_percent"),
    [(GPT3_175B, 2.7, 0.898), (MT_NLG_530B, 1.6, 0.545)],
    ids=["175B", "530B"],
)
def test_selective_overhead_matches_paper(
    config: GPTConfig, paper_percent: float, of_model_percent: float
) -> None:
    """The paper: selective recomputation costs 2.7% (GPT-3 175B) and 1.6% (MT-NLG 530B).

    The recomputed work is the attention core's forward, 4Bs²h per layer. Relative to one
    forward pass of the model (the work the recomputation repeats part of) that is the
    paper's s/(6h + s): 2.70% and 1.64%. Relative to the model FLOPs of an iteration
    (forward + backward) it is a third of that.
    """
    batch = 8
    selective = dataclasses.replace(config, recompute="selective")
    extra = hardware_flops_per_iteration(selective, batch) - model_flops_per_iteration(
        config, batch
    )
    s, h, L = config.seq_length, config.hidden_size, config.num_layers
    assert extra == 4 * batch * s * s * h * L
    of_forward = 100 * extra / forward_flops_per_iteration(config, batch)
    assert of_forward == pytest.approx(paper_percent, abs=0.1)
    assert of_forward == pytest.approx(100 * s / (6 * h + s), abs=0.01)  # logits: ~0.01 pp
    of_model = 100 * extra / model_flops_per_iteration(config, batch)
    assert of_model == pytest.approx(of_model_percent, abs=0.001)


def _counted_flops(config: GPTConfig, batch: int) -> int:
    model = GPT(config, ParallelState.single(), dtype=torch.float32)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_length))
    counter = FlopCounterMode(display=False)
    with counter:
        model(ids, ids).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("ffn_hidden_size", [None, 96], ids=["ffn4h", "ffn96"])
@pytest.mark.parametrize("recompute", ["none", "selective", "lean", "full"])
def test_formulas_equal_counted_matmul_flops(ffn_hidden_size: int | None, recompute: str) -> None:
    """A real forward + backward executes exactly the formula's matmul FLOPs: model FLOPs
    without recomputation, hardware FLOPs with it. Vocab 256 is a multiple of 128, so the
    output layer is not padded."""
    config = GPTConfig(
        vocab_size=256, seq_length=32, hidden_size=64, num_layers=2, num_heads=4,
        ffn_hidden_size=ffn_hidden_size, recompute=recompute,  # type: ignore[arg-type]
    )  # fmt: skip
    counted = _counted_flops(config, batch=2)
    assert counted == hardware_flops_per_iteration(config, 2)
    if recompute == "none":
        assert counted == model_flops_per_iteration(config, 2)
    if ffn_hidden_size is None and recompute == "none":
        assert counted == pytest.approx(_paper_model_flops(config, 2), rel=1e-12)


def test_sdpa_counted_flops_lack_only_the_cpu_kernel() -> None:
    """FlopCounterMode has no formula for the CPU flash kernel, so under ``sdpa`` it counts
    everything but the attention core: forward + backward ``3·4Bs²h`` and the backward's own
    QKᵀ ``2Bs²h`` per layer short of the formula, and nothing else."""
    config = GPTConfig(
        vocab_size=256, seq_length=32, hidden_size=64, num_layers=2, num_heads=4,
        recompute="none", attention="sdpa", attention_dropout=0.0,
    )  # fmt: skip
    b, s, h, L = 2, 32, 64, 2
    core = (3 * 4 + 2) * b * s * s * h * L
    assert _counted_flops(config, b) == hardware_flops_per_iteration(config, b) - core


def test_padded_vocabulary_adds_only_output_layer_flops() -> None:
    """With vocab 300 the output layer computes 384 logits; the formula counts the true 300."""
    config = GPTConfig(
        vocab_size=300, seq_length=32, hidden_size=64, num_layers=2, num_heads=4, recompute="none"
    )
    b, s, h = 2, config.seq_length, config.hidden_size
    padding = config.padded_vocab_size() - config.vocab_size
    assert padding == 84
    counted = _counted_flops(config, b)
    assert counted == model_flops_per_iteration(config, b) + 6 * b * s * h * padding


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="global_batch_size"):
        model_flops_per_iteration(GPT3_175B, 0)
    with pytest.raises(ConfigError, match="recompute"):  # refused when the config is built
        bad = dataclasses.replace(GPT3_175B, recompute="sometimes")  # type: ignore[arg-type]
        hardware_flops_per_iteration(bad, 1)
    with pytest.raises(ValueError, match="size"):
        measure_peak_flops(size=0)
    with pytest.raises(ValueError, match="seconds"):
        measure_peak_flops(seconds=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_peak_flops_is_positive_and_finite(dtype: torch.dtype) -> None:
    flops = measure_peak_flops(dtype=dtype, size=128, seconds=0.05)
    assert math.isfinite(flops) and flops > 0


def test_peak_flops_on_cpu_is_measured() -> None:
    flops = peak_flops(torch.device("cpu"), torch.float32)
    assert math.isfinite(flops) and flops > 0


def test_cpu_peak_starts_no_matmul_after_its_time() -> None:
    """On CPU the clock is read after every matmul: no matmul starts once ``seconds`` have
    passed, so ranks that start measuring together stop together and none measures a stretch
    alone (which on shared cores overstated the peak and halved the MFU). Every matmul's start
    is recorded at dispatch."""
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    starts: list[float] = []

    class Clock(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
                starts.append(time.perf_counter())
            return func(*args, **(kwargs or {}))

    seconds = 0.05
    with Clock():
        measure_peak_flops(size=32, seconds=seconds)
    _, *timed = starts  # the warm-up, then the timed matmuls
    assert len(timed) > 10
    # at most the one matmul after the last clock reading before the deadline starts late (by
    # the loop's overhead); batches doubling in length started hundreds after it
    late = [t for t in timed if t >= timed[0] + seconds]
    assert len(late) <= 1, f"{len(late)} of {len(timed)} matmuls started after {seconds} s"


def test_accelerators_lightning_lacks_read_our_datasheet(monkeypatch: pytest.MonkeyPatch) -> None:
    """An H200 is not in Lightning's table: its peak came from a 1024² matmul measurement, which
    read about 100 TFLOP/s on an H200 and showed MFU=333% in a bf16 fit there (this session's
    GPU run). Now the datasheet's dense rate, by dtype; an unknown chip reads ``None`` (then
    measured at ACCELERATOR_MEASURE_SIZE). The device name is set: no GPU here."""
    from lightning_sp.memory import flops

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert flops.peak_flops(cuda, torch.bfloat16) == 989.4e12
    assert flops._datasheet_flops(cuda, torch.float16) == 989.4e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert flops._datasheet_flops(cuda, torch.float32) == 66.9e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert flops._datasheet_flops(cuda, torch.float32) == 494.7e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert flops._datasheet_flops(cuda, torch.bfloat16) is None
    assert flops.ACCELERATOR_MEASURE_SIZE >= 8192
