"""The saved-tensor trackers on hand-sized graphs: what they count is what autograd keeps.

Every activation figure of the package comes from these trackers, so their rules are tested
here directly, with the bytes written out by hand (float32: 4 bytes per element): views of one
storage count once, parameters (``exclude``) are not activations, bytes go to the innermost
tracked module running, fake tensors count as real ones, and the live tracker sees storages go
when backward releases them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sp.memory.saved import UNTRACKED, LiveActivationTracker, SavedTensorTracker


def _views_of_one_storage(x: torch.Tensor) -> torch.Tensor:
    """``y = 2x`` (a new [4, 6] storage), split into two [4, 3] views multiplied together:
    ``mul`` saves both views, which share ``y``'s 96 bytes; ``exp`` saves its own output."""
    y = x * 2  # a Python scalar: nothing saved
    q, k = y.split(3, dim=1)
    return (q * k).exp()  # saves q and k (one storage, 96 bytes); exp saves its [4, 3] output


def test_views_of_one_storage_count_once() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorTracker() as tracker:
        out = _views_of_one_storage(x)
    assert (tracker.report.total_bytes, tracker.report.count) == (4 * 6 * 4 + 4 * 3 * 4, 2), (
        f"{tracker.report}: views of one storage counted more than once"
    )
    assert tracker.report.per_module == {UNTRACKED: 144}
    out.sum().backward()  # the hooks hand back what autograd saved
    torch.testing.assert_close(x.grad[:, :3], 4 * x[:, 3:].detach() * out.detach())


def test_parameters_are_excluded_and_bytes_go_to_the_innermost_module() -> None:
    inner = nn.Linear(6, 5, bias=False)  # saves its input and its weight
    outer = nn.Sequential(inner, nn.Tanh())  # tanh saves its output [4, 5]
    x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorTracker({"outer": outer, "outer.0": inner}) as counted_weights:
        outer(x)
    # the weight (5·6·4 = 120 bytes) counts when not excluded
    assert counted_weights.report.per_module == {"outer.0": 96 + 120, "outer": 80}
    with SavedTensorTracker(
        {"outer": outer, "outer.0": inner}, exclude=list(outer.parameters())
    ) as tracker:
        outer(x)
    assert tracker.report.per_module == {"outer.0": 96, "outer": 80}, (
        f"{tracker.report.per_module}: parameters counted as activations"
    )
    assert tracker.report.total_bytes == 176
    # for_model excludes the model's parameters and attributes to its layers
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
    with SavedTensorTracker.for_model(model) as tracker:
        model.layers[1](model.layers[0](x))
    assert tracker.report.per_module == {"layers.0": 96, "layers.1": 96}


def test_fake_tensors_count_as_real_ones() -> None:
    real_x = torch.randn(4, 6, requires_grad=True)
    with SavedTensorTracker() as real:
        _views_of_one_storage(real_x)
    with FakeTensorMode():
        fake_x = torch.empty(4, 6, requires_grad=True)
        with SavedTensorTracker() as fake:
            _views_of_one_storage(fake_x)
    assert (fake.report.total_bytes, fake.report.count) == (144, 2)
    assert fake.report.per_module == real.report.per_module


def test_live_tracker_sees_storages_go_in_backward() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    with LiveActivationTracker() as tracker:
        a = _views_of_one_storage(x)  # 144 bytes
        b = _views_of_one_storage(x)  # another 144: its own storages
        assert tracker.live_bytes == tracker.peak_bytes == 288
        a.sum().backward()
        assert tracker.live_bytes == 144, "a's saved storages outlived its backward"
        b.sum().backward()
    assert (tracker.live_bytes, tracker.peak_bytes) == (0, 288)
