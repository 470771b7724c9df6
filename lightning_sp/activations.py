"""Measure the activation memory autograd keeps for backward.

Inside :class:`SavedTensorTracker`, every tensor that autograd saves passes through
``torch.autograd.graph.saved_tensors_hooks``. The tracker counts each storage once (views of
one tensor, such as Q, K and V sliced from a QKV output, share it), skips storages that belong
to parameters or buffers, and attributes the bytes to the innermost tracked module that was
running when the storage was first saved (for example ``layers.3``).

Storages are identified by their ``StorageImpl`` address, which also works under
``FakeTensorMode``, where tensors have no data pointers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

UNTRACKED = "<untracked>"


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class ActivationReport:
    """Bytes saved for backward: in total and per tracked module."""

    total_bytes: int = 0
    per_module: dict[str, int] = field(default_factory=dict)
    count: int = 0

    def bytes_of(self, name: str) -> int:
        return self.per_module.get(name, 0)


class SavedTensorTracker:
    """Context manager that measures the storages autograd saves while it is active.

    ``modules`` maps names to modules whose forward passes the bytes are attributed to;
    ``exclude`` lists tensors (parameters, buffers) whose storages are not activations.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module] | None = None,
        exclude: Iterable[Tensor] = (),
    ) -> None:
        self.report = ActivationReport()
        self._excluded = {_storage_key(t) for t in exclude}
        self._seen: set[int] = set()
        self._stack: list[str] = []
        self._modules = modules or {}
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @classmethod
    def for_model(cls, model: nn.Module, layer_container: str = "layers") -> SavedTensorTracker:
        """Attribute to each child of ``model.<layer_container>``, excluding ``model``'s
        parameters and buffers."""
        container = getattr(model, layer_container, None)
        modules = (
            {f"{layer_container}.{n}": m for n, m in container.named_children()}
            if container is not None
            else {}
        )
        return cls(modules, exclude=[*model.parameters(), *model.buffers()])

    def _pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key in self._excluded or key in self._seen:
            return t
        self._seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        owner = self._stack[-1] if self._stack else UNTRACKED
        report = self.report
        report.total_bytes += nbytes
        report.count += 1
        report.per_module[owner] = report.per_module.get(owner, 0) + nbytes
        return t

    def _enter_hook(self, name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self._stack.append(name)

        return hook

    def _exit_hook(self, *_: object) -> None:
        self._stack.pop()

    def __enter__(self) -> SavedTensorTracker:
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._enter_hook(name)))
            self._handles.append(module.register_forward_hook(self._exit_hook, always_call=True))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def measure_saved_activations(
    fn: Callable[[], Any],
    modules: dict[str, nn.Module] | None = None,
    exclude: Iterable[Tensor] = (),
) -> tuple[Any, ActivationReport]:
    """Run ``fn()`` and report the bytes autograd saved for its backward.

    Returns ``(fn's result, report)``. Keep the result alive until you have read the report
    if you also want to run backward.
    """
    with SavedTensorTracker(modules, exclude) as tracker:
        out = fn()
    return out, tracker.report
