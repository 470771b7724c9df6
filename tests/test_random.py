"""Every dropout in the model draws its mask from the right stream, and recompute replays it.

Paper §4.2.2: a dropout on an activation that is replicated over the tensor-parallel group
(the embedding and residual dropouts without sequence parallelism) must draw the same mask on
every TP rank, or the replicas diverge; one on an activation whose shards differ per rank (the
attention probabilities, which are different heads on each rank; every dropout under sequence
parallelism, which sees a different sequence shard on each rank) must draw different masks, or
the shards are correlated. Drawing the attention dropout from the replicated stream keeps the
model's gradients consistent, so no parity test can see it: only the masks show it.

Real gloo ranks, t=2, float64, every attention backend, sequence parallelism off and on, every
recompute policy. Each mask is observed where it is drawn (every call of
``lightning_sp.parallel.random.dropout`` is recorded, with the generator it drew from and the
elements it kept), gathered over the TP group and compared; under recompute, the masks redrawn
in backward must equal the forward's, and the forward's must equal those of no recompute.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import lightning_sp.model
from lightning_sp import GPT, GPTConfig, ParallelState
from lightning_sp.parallel import random as random_module
from lightning_sp.parallel.random import default_generator, drawing_from
from lightning_sp.testing.spawn import run_distributed

from models import batch, tiny_config

POLICIES = ("none", "selective", "full")
# the sites of one forward, in order: the embedding's dropout, then per layer the attention
# probabilities' and the two residual branches'
LAYER_SITES = ("attention", "attention residual", "mlp residual")
# recompute redraws, per layer and in forward order, the masks of these sites
REDRAWN = {"none": (), "selective": ("attention",), "full": LAYER_SITES}


def attention_backends() -> tuple[str, ...]:
    """The attention backends the model offers: ``ATTENTION_BACKENDS`` of whichever module of
    ``lightning_sp.model`` defines it, else the one built-in (``math``)."""
    for info in pkgutil.iter_modules(lightning_sp.model.__path__):
        module = importlib.import_module(f"lightning_sp.model.{info.name}")
        registry = getattr(module, "ATTENTION_BACKENDS", None)
        if registry is not None:
            return tuple(registry)
    return ("math",)


def _config(backend: str, **overrides: object) -> GPTConfig:
    if any(f.name == "attention" for f in dataclasses.fields(GPTConfig)):
        overrides["attention"] = backend
    else:
        assert backend == "math", f"no GPTConfig.attention field to select {backend!r}"
    # only the math backend draws the attention mask through lightning_sp's dropout (sdpa
    # seeds torch's, and on CPU refuses attention dropout): the others are checked without it
    attention_dropout = 0.3 if backend == "math" else 0.0
    return tiny_config(hidden_dropout=0.3, attention_dropout=attention_dropout, **overrides)


@dataclasses.dataclass
class Draw:
    """One dropout mask as drawn: the stream, whether in backward, and what it kept."""

    stream: str
    backward: bool
    kept: Tensor  # bool; False where dropped (and where the input was already 0)


class DropoutRecorder:
    """Records every mask ``lightning_sp.parallel.random.dropout`` draws while active.

    The real dropout runs; the recorder sees its input and output (``kept = out != 0``) and
    names its generator: ``replicated`` or ``sharded`` of ``rng``, else ``other``.
    """

    def __init__(self, rng: random_module.RNGStreams) -> None:
        self.rng, self.draws, self.backward = rng, [], False

    def _stream(self, generator: torch.Generator) -> str:
        if generator is self.rng.replicated:
            return "replicated"
        return "sharded" if generator is self.rng.sharded else "other"

    def _recording(self, real: type) -> type:
        recorder = self

        class Recording(real):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx, x: Tensor, p: float, generator: torch.Generator) -> Tensor:
                out = real.forward(ctx, x, p, generator)
                kept = out.detach() != 0
                recorder.draws.append(Draw(recorder._stream(generator), recorder.backward, kept))
                return out

        return Recording

    @contextmanager
    def active(self) -> Iterator[DropoutRecorder]:
        names = [n for n in ("_Dropout", "_RegeneratedDropout") if hasattr(random_module, n)]
        reals = {n: getattr(random_module, n) for n in names}
        for name, real in reals.items():
            setattr(random_module, name, self._recording(real))
        try:
            yield self
        finally:
            for name, real in reals.items():
                setattr(random_module, name, real)


def _site_names(num_layers: int, attention: bool = True) -> list[str]:
    sites = [s for s in LAYER_SITES if attention or s != "attention"]
    return ["embedding"] + [f"layers.{i} {s}" for i in range(num_layers) for s in sites]


def _expected_stream(site: str, sequence_parallel: bool) -> str:
    """Sharded where the activation differs per TP rank, replicated where it is the same."""
    return "sharded" if sequence_parallel or site.endswith(" attention") else "replicated"


def _run(config: GPTConfig, state: ParallelState) -> tuple[list[Draw], list[Draw]]:
    """One forward and backward; the masks drawn in each."""
    model = GPT(config, state, dtype=torch.float64)
    model.train()
    ids, labels = batch(config)
    recorder = DropoutRecorder(model.rng)
    with recorder.active():
        loss = model(ids, labels)
        recorder.backward = True
        loss.backward()
    forward = [d for d in recorder.draws if not d.backward]
    return forward, [d for d in recorder.draws if d.backward]


def _differs_across_tp(kept: Tensor, state: ParallelState) -> bool:
    gathered = [
        torch.empty_like(kept, dtype=torch.uint8) for _ in range(state.tensor_parallel_size)
    ]
    dist.all_gather(gathered, kept.to(torch.uint8), group=state.tp_group)
    return not all(torch.equal(g, gathered[0]) for g in gathered[1:])


def _check_case(backend: str, sequence_parallel: bool, state: ParallelState) -> None:
    num_layers = tiny_config().num_layers
    sites = _site_names(num_layers, attention=backend == "math")
    baseline: list[Draw] | None = None
    for policy in POLICIES:
        case = f"attention={backend} sp={sequence_parallel} recompute={policy}"
        config = _config(backend, sequence_parallel=sequence_parallel, recompute=policy)
        forward, backward = _run(config, state)
        assert len(forward) == len(sites), (
            f"{case}: {len(forward)} dropout masks drawn through lightning_sp.parallel.random "
            f"in forward, expected {len(sites)} ({', '.join(sites)}): a dropout bypasses the "
            "model's RNG streams"
        )
        for site, draw in zip(sites, forward, strict=True):
            expected = _expected_stream(site, sequence_parallel)
            assert draw.stream == expected, (
                f"{case}: {site} dropout draws from the {draw.stream} stream, expected the "
                f"{expected} stream"
            )
            differs = _differs_across_tp(draw.kept, state)
            assert differs == (expected == "sharded"), (
                f"{case}: {site} dropout masks are {'different' if differs else 'identical'} "
                f"on the two TP ranks, but the activation is "
                f"{'sharded (must differ)' if expected == 'sharded' else 'replicated (must match)'}"
            )
        # recompute's forward draws what no recompute draws ...
        if baseline is None:
            baseline = forward
        for site, draw, base in zip(sites, forward, baseline, strict=True):
            assert torch.equal(draw.kept, base.kept), (
                f"{case}: {site} forward mask differs from the one drawn with recompute=none"
            )
        # ... and backward redraws it identically, layer by layer from the last
        redrawn = [
            (f"layers.{i} {s}", forward[sites.index(f"layers.{i} {s}")])
            for i in reversed(range(num_layers))
            for s in REDRAWN[policy]
            if f"layers.{i} {s}" in sites
        ]
        assert len(backward) == len(redrawn), (
            f"{case}: {len(backward)} masks redrawn in backward, expected {len(redrawn)}"
        )
        for (site, original), replay in zip(redrawn, backward, strict=True):
            assert replay.stream == original.stream and torch.equal(replay.kept, original.kept), (
                f"{case}: {site} dropout mask recomputed in backward differs from the forward's "
                "(recompute does not replay the RNG state)"
            )


def _worker(rank: int, world_size: int, backends: tuple[str, ...]) -> None:
    state = ParallelState.from_process_group(tensor_parallel_size=world_size)
    for backend in backends:
        for sequence_parallel in (False, True):
            _check_case(backend, sequence_parallel, state)


def test_dropout_masks_come_from_the_right_stream_and_replay() -> None:
    """t=2: sharded activations draw different masks per TP rank, replicated ones identical
    masks; recompute redraws the forward's masks, for every attention backend."""
    run_distributed(_worker, 2, attention_backends())


def test_attention_backends_include_math() -> None:
    assert "math" in attention_backends()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recorder_sees_every_dropout_of_one_process(sequence_parallel: bool) -> None:
    """t=1: the recorder sees every site, names the stream the model hands it, and sees masks
    that drop what dropout 0.3 drops (the comparison across ranks needs t > 1, above)."""
    config = _config("math", sequence_parallel=sequence_parallel, recompute="none")
    forward, backward = _run(config, ParallelState.single())
    sites = _site_names(config.num_layers)
    assert [d.stream for d in forward] == [_expected_stream(s, sequence_parallel) for s in sites]
    assert backward == []
    # residual and embedding inputs have no zeros, so what is not kept was dropped
    residual = [
        d.kept.flatten() for s, d in zip(sites, forward, strict=True) if s[-9:] != "attention"
    ]
    kept = torch.cat(residual).double().mean().item()
    assert 0.65 < kept < 0.75, f"kept fraction {kept:.3f}, dropout 0.3 keeps 0.7"


def test_drawing_from_swaps_the_generator_in_and_restores_the_default() -> None:
    """Ops without a generator inside the block draw what they would from ``generator``
    itself, advance it by that much, and leave torch's default generator where it was, also
    when the block raises; a device without a default generator is refused."""
    global_state = torch.get_rng_state()
    ours, reference = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    with drawing_from(ours):
        drawn = torch.rand(5)
    assert torch.equal(drawn, torch.rand(5, generator=reference))
    assert torch.equal(ours.get_state(), reference.get_state())  # advanced by what was drawn
    assert torch.equal(torch.get_rng_state(), global_state)
    with pytest.raises(RuntimeError, match="inside"), drawing_from(ours):
        torch.rand(3)
        raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), global_state)
    with pytest.raises(ValueError, match="meta"):
        default_generator(torch.device("meta"))
