"""The MoE layer's saved bytes per rank equal its part's formula to the byte (bf16, forced
balanced routing, saved-tensor hooks), at t = 1 and t = 2 with SP, e = 1, 2, 4, and with the
experts split over TP (etp = 2) at e = 1, 2: expert parallelism moves rows but, balanced, does
not divide them; expert tensor parallelism divides the f_e terms and keeps the TP group's
gathered expert input rows whole on every TP rank."""

from __future__ import annotations

import pytest
import torch

from lightning_sp.memory.saved import SavedTensorTracker
from lightning_sp.model.moe.config import MoEConfig
from lightning_sp.model.moe.layer import MoE
from lightning_sp.model.moe.part import MoEFeedForward
from lightning_sp.model.parts.base import INSIDE, OUTSIDE
from lightning_sp.model.shape import ActivationShape
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.state import ParallelState
from lightning_sp.testing.spawn import run_distributed

from models import layout_at, moe_context, shape_at

S, B, H = 32, 2, 64
CONFIG = MoEConfig(num_experts=8, top_k=2, expert_ffn_size=32, num_shared_experts=1,
                   aux_loss_coef=0.01, z_loss_coef=0.001, force_balanced=True)  # fmt: skip


def _formula(t: int, e: int, sp: bool, etp: int = 1) -> float:
    """Bytes one rank saves: the part's terms split by region (replicated: whole), plus the
    aux loss's counts."""
    shape = ActivationShape(s=S, b=B, h=H, a=4, t=t, sequence_parallel=sp, e=e, etp=etp)
    terms = MoEFeedForward(CONFIG).saved_terms(shape)
    per_rank = sum(
        b / (t if region == INSIDE or (sp and region == OUTSIDE) else 1)
        for b, region in terms.values()
    )
    return per_rank + 4 * CONFIG.num_experts  # fp32 counts of the load-balancing loss


def _measure(state: ParallelState, sp: bool, recompute_act: bool = False) -> int:
    ctx = moe_context(CONFIG, H, state, sequence_parallel=sp, recompute_act=recompute_act,
                      dtype=torch.bfloat16)  # fmt: skip
    moe = MoE(ctx, CONFIG)
    moe.reset_parameters(3)
    s = S // state.tensor_parallel_size if sp else S
    x = torch.randn(s, B, H, dtype=torch.bfloat16, requires_grad=True)
    tracker = SavedTensorTracker(exclude=[*moe.parameters(), *moe.buffers()])
    with tracker:
        out = moe(x)
    out.float().square().sum().backward()  # the graph is sound
    return tracker.report.total_bytes


def _worker(rank: int, world_size: int) -> list[tuple[str, int, float]]:
    results = []
    for t, e, etp in ((1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2)):
        state = ParallelState.from_process_group(
            tensor_parallel_size=t, expert_parallel_size=e, expert_tensor_parallel_size=etp
        )
        sp = t > 1
        measured, expected = _measure(state, sp), _formula(t, e, sp, etp)
        case = f"t={t} e={e} etp={etp}"
        assert measured == expected, f"{case}: measured {measured} vs formula {expected}"
        results.append((case, measured, expected))
    return results


def test_moe_saved_bytes_equal_formula_one_process() -> None:
    assert _measure(ParallelState.single(), False) == _formula(1, 1, False)


def test_mlp_act_recompute_drops_the_down_projection_inputs() -> None:
    """``mlp_act`` drops exactly the terms it names: the experts' and shared experts' down
    projection inputs."""
    from lightning_sp.model.recompute import RECOMPUTE_MODULES

    shape = ActivationShape(s=S, b=B, h=H, a=4)
    terms = MoEFeedForward(CONFIG).saved_terms(shape)
    dropped = sum(terms[n][0] for n in RECOMPUTE_MODULES["mlp_act"].drops if n in terms)
    assert dropped == 2 * (2 * S * B) * 32 + 2 * S * B * 32  # e·N·f_e and e·T·f_s
    measured = _measure(ParallelState.single(), False, recompute_act=True)
    assert measured == _formula(1, 1, False) - dropped


@pytest.mark.slow
def test_moe_saved_bytes_equal_formula_every_layout() -> None:
    run_distributed(_worker, 4)


@pytest.mark.parametrize(("t", "etp"), [(1, 1), (2, 1), (2, 2)])
def test_fake_measurement_of_an_moe_model_equals_its_formula(t: int, etp: int) -> None:
    """The planner's measurement (one layer of rank 0's shard under fake tensors, which route
    force-balanced: ``GPTConfig.for_measurement``) equals the layer formula plus the norms'
    statistics and the load-balancing counts (4E bytes), to the byte."""
    import dataclasses

    from lightning_sp import GPTConfig
    from lightning_sp.memory.fake import measure_activations
    from lightning_sp.memory.formulas import (
        activation_bytes_per_layer,
        layernorm_stats_bytes_per_layer,
    )

    config = GPTConfig.of(
        "llama", vocab_size=257, seq_length=256, hidden_size=128, num_layers=2, num_heads=8,
        num_query_groups=2, feed_forward="moe", recompute="none", sequence_parallel=t > 1,
        moe=dataclasses.replace(CONFIG, num_shared_experts=0, force_balanced=False),
    )  # fmt: skip
    layout = ParallelConfig(tensor_parallel_size=t, expert_tensor_parallel_size=etp)
    measured = measure_activations(config, layout, micro_batch_size=2, layers=1)
    shape = config.activation_shape(layout_at(t, etp=etp), 2)
    expected = activation_bytes_per_layer(shape, "none") + layernorm_stats_bytes_per_layer(
        shape, "none"
    )
    assert measured.bytes_per_layer == expected + 4 * CONFIG.num_experts


def test_mixtral_8x7b_parameters_total_active_and_per_rank() -> None:
    """configs/mixtral_8x7b.yaml's model: 46.7B parameters, 12.9B active (Mistral's published
    figures), and 1.64B on a rank of t=2, p=4, e=8 (each rank 1 of the 8 experts)."""
    from pathlib import Path

    import yaml

    from lightning_sp import GPTConfig
    from lightning_sp.memory.model_state import (
        model_active_parameter_count,
        model_parameter_count,
        parameters_per_rank,
    )

    path = Path(__file__).parent.parent / "configs" / "mixtral_8x7b.yaml"
    fields = yaml.safe_load(path.read_text())["model"]["config"]
    config = GPTConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})
    assert model_parameter_count(config) == 46_702_792_704
    assert model_active_parameter_count(config) == 12_879_925_248
    assert parameters_per_rank(config, layout_at(2, p=4, e=8)) == 1_642_926_080
    assert parameters_per_rank(config, layout_at(2, p=4, e=1)) > 7 * parameters_per_rank(
        config, layout_at(2, p=4, e=8)
    )


def test_qwen3_30b_a3b_parameters_total_and_active() -> None:
    """configs/qwen3_30b_a3b.yaml's model: 30.5B parameters, 3.3B active (Qwen's figures)."""
    from pathlib import Path

    import yaml

    from lightning_sp import GPTConfig
    from lightning_sp.memory.model_state import model_active_parameter_count, model_parameter_count

    path = Path(__file__).parent.parent / "configs" / "qwen3_30b_a3b.yaml"
    fields = yaml.safe_load(path.read_text())["model"]["config"]
    config = GPTConfig(**{**fields, "moe": MoEConfig(**fields["moe"])})
    assert model_parameter_count(config) == 30_532_122_624
    assert model_active_parameter_count(config) == 3_353_032_704


def test_step_time_prices_the_expert_all_to_alls() -> None:
    """configs/mixtral_8x7b.yaml's layout: 4 all-to-alls per layer and micro-batch (dispatch and
    combine, forward and backward) of the k·s·b/t rows a rank routes, over e = 8 ranks (at
    t = 2 four in each of two nodes: 3/8 of the rows over NVLink, 4/8 over the network):
    present at e = 8, absent at e = 1 and in a dense model."""
    import dataclasses

    from lightning_sp import GPTConfig
    from lightning_sp.planner.kernels import all_to_all_seconds
    from lightning_sp.planner.layout import Layout
    from lightning_sp.planner.presets import load_cluster
    from lightning_sp.planner.steptime import layer_time, step_time

    config = GPTConfig.of(
        "mistral", vocab_size=32000, seq_length=4096, hidden_size=4096, num_layers=32,
        num_heads=32, num_query_groups=8, feed_forward="moe", sequence_parallel=True,
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_size=14336), attention="sdpa",
    )  # fmt: skip
    cluster = load_cluster("h100-80gb")
    layer = layer_time(shape_at(config, 2, 1, e=8), cluster)
    rows = 2 * 2 * 4096 // 2 * 4096  # bytes: bf16, k = 2, s·b/t tokens, h
    expected = all_to_all_seconds(cluster, rows, 8, 4)
    assert layer.forward["ep"] == layer.backward["ep"] == 2 * expected > 0
    assert layer_time(shape_at(config, 2, 1, e=1), cluster).forward["ep"] == 0
    dense = dataclasses.replace(config, feed_forward="dense", moe=None)
    assert layer_time(shape_at(dense, 2, 1, e=8), cluster).forward["ep"] == 0
    layout = Layout(tensor_parallel_size=2, pipeline_parallel_size=4, data_parallel_size=8,
                    expert_parallel_size=8, num_microbatches=16, config=config)  # fmt: skip
    assert step_time(layout, cluster).parts["ep"] == 16 * 8 * 4 * expected


def test_search_tries_expert_parallel_sizes() -> None:
    """The layout search tries every e dividing both d·c and E (SP rows only at t > 1 for an
    MoE model), with and without the distributed optimizer, and etp in {1, t}; a dense model
    only e = 1."""
    import dataclasses

    from lightning_sp import GPTConfig
    from lightning_sp.planner.layout import Layout
    from lightning_sp.planner.search import _layouts

    config = GPTConfig.of(
        "mistral", vocab_size=1000, seq_length=256, hidden_size=64, num_layers=4, num_heads=4,
        feed_forward="moe", sequence_parallel=True,
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32),
    )  # fmt: skip
    base = Layout(tensor_parallel_size=2, data_parallel_size=4, config=config, micro_batch_size=2)
    layouts = [layout for layout, _ in _layouts(base, 2)]
    for layout in layouts:
        d_c = layout.data_parallel_size * layout.context_parallel_size
        assert d_c % layout.expert_parallel_size == 0 and 4 % layout.expert_parallel_size == 0
    assert {x.expert_parallel_size for x in layouts} == {1, 2, 4}
    assert any(x.distributed_optimizer and x.expert_parallel_size == 4 for x in layouts)
    assert any(x.tensor_parallel_size == 2 for x in layouts)
    by_t = {t: {x.expert_tensor_parallel_size for x in layouts if x.tensor_parallel_size == t}
            for t in (1, 2)}  # fmt: skip
    assert by_t == {1: {1}, 2: {1, 2}}  # etp in {1, t}
    dense = dataclasses.replace(base, config=dataclasses.replace(config, feed_forward="dense"))
    assert {x.expert_parallel_size for x, _ in _layouts(dense, 2)} == {1}


def test_estimate_shards_expert_optimizer_state_over_the_expert_data_group() -> None:
    """With the distributed optimizer, dense weights' fp32 master and Adam moments split over
    d·c ranks, the routed experts' over the d·c/e that hold them."""
    from lightning_sp import GPTConfig
    from lightning_sp.memory.model_state import expert_parameters_per_rank, parameters_per_rank
    from lightning_sp.planner.estimate import estimate
    from lightning_sp.planner.layout import Layout

    config = GPTConfig.of(
        "mistral", vocab_size=1000, seq_length=256, hidden_size=64, num_layers=4, num_heads=4,
        feed_forward="moe", moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_size=32),
    )  # fmt: skip
    layout = Layout(data_parallel_size=8, expert_parallel_size=4, distributed_optimizer=True,
                    config=config)  # fmt: skip
    total, experts = (
        parameters_per_rank(config, layout_at(1, p=1, e=4)),
        expert_parameters_per_rank(config, layout_at(1, p=1, e=4)),
    )
    assert experts == 4 * 8 * 3 * 64 * 32 // 4
    expected = (total - experts) * (6 + 12 / 8) + experts * (6 + 12 / 2)
    assert estimate(layout, measure=False).rows[0].model_state_bytes == round(expected)


def test_expert_tensor_parallel_size_reaches_the_estimate() -> None:
    """``--trainer.strategy.init_args.expert_tensor_parallel_size 2`` on Mixtral's config:
    the layout carries it; each rank holds half of every routed expert's f_e (parameters per
    rank drop by exactly half the rank's L/p·E/e·3·h·f_e), and its model state with them; the
    expert GEMMs are f_e/2 wide over the TP group's gathered rows; step time adds the layer's
    all-gather and reduce-scatter each way. 3 (neither 1 nor t = 2) is one line."""
    from pathlib import Path

    from lightning_sp import ConfigError
    from lightning_sp.cli.estimate import read_estimate_args
    from lightning_sp.memory.model_state import parameters_per_rank
    from lightning_sp.planner.estimate import estimate
    from lightning_sp.planner.ops import layer_gemms
    from lightning_sp.planner.presets import load_cluster
    from lightning_sp.planner.steptime import layer_time

    path = str(Path(__file__).parent.parent / "configs" / "mixtral_8x7b.yaml")
    knob = "--trainer.strategy.init_args.expert_tensor_parallel_size"
    base = read_estimate_args(["--config", path]).layout
    layout = read_estimate_args(["--config", path, knob, "2"]).layout
    assert (base.expert_tensor_parallel_size, layout.expert_tensor_parallel_size) == (1, 2)
    cfg = layout.config
    assert cfg.moe is not None
    h, f_e, e = cfg.hidden_size, cfg.moe.expert_ffn_size, layout.expert_parallel_size
    half = cfg.num_layers // 4 * (cfg.moe.num_experts // e) * 3 * h * f_e // 2
    assert (
        parameters_per_rank(cfg, layout_at(2, p=4, e=e, etp=2))
        == parameters_per_rank(cfg, layout_at(2, p=4, e=e)) - half
    )
    before, after = (estimate(x, measure=False) for x in (base, layout))
    assert after.parameters_per_rank == before.parameters_per_rank - half
    drop = before.rows[0].model_state_bytes - after.rows[0].model_state_bytes
    assert drop == 18 * half  # replicated mixed-precision Adam: 18 bytes per parameter
    gemms = {g.name: g for g in layer_gemms(shape_at(cfg, 2, 1, etp=2))}
    whole = {g.name: g for g in layer_gemms(shape_at(cfg, 2, 1))}
    assert gemms["expert_gate_up"].n == whole["expert_gate_up"].n // 2 == f_e
    assert gemms["expert_down"].k == f_e // 2
    assert gemms["expert_gate_up"].m == 2 * whole["expert_gate_up"].m  # all s tokens, not s/t
    cluster = load_cluster("h100-80gb")
    one, split = (
        layer_time(shape_at(cfg, 2, 1, e=e), cluster),
        layer_time(shape_at(cfg, 2, 1, e=e, etp=2), cluster),
    )
    unit = (split.forward["tp"] - one.forward["tp"]) / 2
    assert unit > 0 and split.backward["tp"] - one.backward["tp"] == 2 * unit
    with pytest.raises(ConfigError) as info:
        read_estimate_args(["--config", path, knob, "3"])
    message = str(info.value)
    assert "\n" not in message and "expert_tensor_parallel_size=3 must be 1 or 2" in message


def test_estimate_counts_the_expert_parallel_regroup_indices() -> None:
    """One expert-parallel size: the layout's e reaches the estimate's formula (``x.e``) and
    its fake-tensor trace (the MoE module at e); at e = 2 both rise by the regroup indices
    over e = 1, 16 bytes per routed row, N = k·s·b/t = 2·64·2/2 = 128 rows: 2048 bytes (the
    rest of each row's gap, the per-expert counts and norm statistics the formula leaves
    out, is the same at both e)."""
    from lightning_sp import GPTConfig
    from lightning_sp.planner.estimate import estimate
    from lightning_sp.planner.layout import Layout

    config = GPTConfig.of(
        "mistral", vocab_size=1000, seq_length=64, hidden_size=32, num_layers=2, num_heads=4,
        feed_forward="moe", sequence_parallel=True,
        moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_size=96),
    )  # fmt: skip
    rows = {}
    for e in (1, 2):
        layout = Layout(tensor_parallel_size=2, data_parallel_size=4, expert_parallel_size=e,
                        micro_batch_size=2, config=config)  # fmt: skip
        [row] = [r for r in estimate(layout).rows if r.sequence_parallel and r.recompute == "none"]
        rows[e] = row
    indices = 16 * 2 * 64 * 2 // 2
    assert rows[2].formula_bytes_per_layer - rows[1].formula_bytes_per_layer == indices
    assert rows[2].activation_bytes_per_layer - rows[1].activation_bytes_per_layer == indices


@pytest.mark.parametrize("recompute", ["none", "selective", "lean", "layernorm", "mlp_act"])
def test_moe_layer_of_a_gpt_equals_its_formula_under_each_recompute(recompute: str) -> None:
    """A whole MoE layer of a GPT (bf16, one process) saves its formula's bytes plus its norms'
    statistics under every preset and module. Under ``layernorm`` the attention's norm is
    replayed inside the QKV linear's backward, while the MoE layer's norm, whose output the
    router keeps, runs as it is and keeps its fp32 statistics (``4sb``): a formula that
    dropped both norms' statistics was 128 bytes short here."""
    import dataclasses

    from lightning_sp import GPT, GPTConfig
    from lightning_sp.memory.formulas import (
        activation_bytes_per_layer,
        layernorm_stats_bytes_per_layer,
    )

    s, b, h = 16, 2, 32
    moe = dataclasses.replace(CONFIG, num_experts=4, aux_loss_coef=0.0, z_loss_coef=0.0)
    config = GPTConfig.of(
        "llama", vocab_size=64, seq_length=s, hidden_size=h, num_layers=1, num_heads=4,
        num_query_groups=4, feed_forward="moe", moe=moe,
        recompute=recompute if recompute in ("none", "selective", "lean") else [recompute],
    )  # fmt: skip
    model = GPT(config, ParallelState.single(), dtype=torch.bfloat16).train()
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(0))
    with SavedTensorTracker.for_model(model) as tracker:
        loss = model(ids, ids)
    loss.backward()  # the saved tensors were real
    measured = tracker.report.bytes_of("layers.0")
    shape = config.activation_shape(layout_at(1), b)
    expected = activation_bytes_per_layer(shape, config.recompute)
    expected += layernorm_stats_bytes_per_layer(shape, config.recompute)
    assert measured == expected, f"{recompute}: measured {measured} bytes, formula {expected}"


def test_search_json_names_each_layouts_expert_sizes() -> None:
    """``estimate --search --format json``: each row names its layout whole, e and etp
    included, so two rows that differ only in the expert layout are told apart (the table
    prints both columns)."""
    from lightning_sp import GPTConfig
    from lightning_sp.planner.layout import Layout
    from lightning_sp.planner.presets import H100_80GB
    from lightning_sp.planner.report import _candidate_json
    from lightning_sp.planner.search import search

    config = GPTConfig.of(
        "mistral", vocab_size=1000, seq_length=256, hidden_size=64, num_layers=4, num_heads=4,
        feed_forward="moe", sequence_parallel=True, recompute="none",
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_size=32),
    )  # fmt: skip
    base = Layout(tensor_parallel_size=2, data_parallel_size=2, config=config)
    found = search(base, H100_80GB, 80e9, max_micro_batch=1)
    rows = [_candidate_json(x) for x in found.ranked]
    for x, row in zip(found.ranked, rows, strict=True):
        lay = x.layout
        got = (row.get("expert_parallel_size"), row.get("expert_tensor_parallel_size"))
        want = (lay.expert_parallel_size, lay.expert_tensor_parallel_size)
        assert got == want, f"search JSON row: (e, etp) = {got}, the layout's {want}"
    assert {r["expert_parallel_size"] for r in rows} == {1, 2, 4}
    sizes = [tuple(v for k, v in r.items() if k.endswith("_size")) for r in rows]
    named = [(*size, r["distributed_optimizer"], r["sequence_parallel"], r["recompute"])
             for size, r in zip(sizes, rows, strict=True)]  # fmt: skip
    assert len(set(named)) == len(named), "two search JSON rows name the same layout"
