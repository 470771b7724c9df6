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
from typing_extensions import Self

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


class _AttributedHooks:
    """Saved-tensor hooks that know which tracked module is running.

    ``modules`` maps names to modules; while one runs forward, :meth:`_owner` is its name (the
    innermost one), else ``"<untracked>"``. Storages of ``exclude`` (parameters, buffers) are
    not activations. Subclasses provide ``_pack``, ``_unpack`` and their counters
    (:meth:`_start`).
    """

    def __init__(
        self, modules: dict[str, nn.Module] | None = None, exclude: Iterable[Tensor] = ()
    ) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._stack: list[str] = []
        self._modules = modules or {}
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._start()

    def _start(self) -> None:
        """Set up the subclass's counters (at construction)."""

    def _pack(self, t: Tensor) -> Any:
        raise NotImplementedError

    def _unpack(self, packed: Any) -> Tensor:
        return packed

    def _owner(self) -> str:
        return self._stack[-1] if self._stack else UNTRACKED

    def _enter_hook(self, name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            self._stack.append(name)

        return hook

    def _exit_hook(self, *_: object) -> None:
        self._stack.pop()

    def __enter__(self) -> Self:
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


class SavedTensorTracker(_AttributedHooks):
    """Context manager that measures the storages autograd saves while it is active.

    ``modules`` maps names to modules whose forward passes the bytes are attributed to;
    ``exclude`` lists tensors (parameters, buffers) whose storages are not activations.
    """

    def _start(self) -> None:
        self.report = ActivationReport()
        self._seen: set[int] = set()

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
        owner = self._owner()
        report = self.report
        report.total_bytes += nbytes
        report.count += 1
        report.per_module[owner] = report.per_module.get(owner, 0) + nbytes
        return t


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


class _SavedRef:
    """What autograd keeps in place of a saved tensor while :class:`LiveActivationTracker` is
    active: the tensor, and who to tell when autograd drops it (after the node's backward, or
    when the graph is freed)."""

    __slots__ = ("_key", "_tracker", "tensor")

    def __init__(self, tensor: Tensor, tracker: LiveActivationTracker, key: int) -> None:
        self.tensor, self._tracker, self._key = tensor, tracker, key

    def __del__(self) -> None:
        self._tracker._release(self._key)


class LiveActivationTracker(_AttributedHooks):
    """Context manager that follows the bytes autograd holds for backward over time.

    Where :class:`SavedTensorTracker` adds up everything saved during a forward pass, this
    tracker also sees the bytes go: a storage counts from the moment autograd first saves a
    tensor of it until autograd has released every saved reference to it (each node releases
    its saved tensors after its backward). ``live_bytes`` is the current total and
    ``peak_bytes`` its maximum, which is the activation memory of a pipeline schedule that
    keeps several micro-batches in flight. Storages of ``exclude`` (parameters, buffers) are
    not counted; views of one storage count once.

    ``modules`` maps names to modules as in :class:`SavedTensorTracker`: each storage is
    attributed to the innermost tracked module running when it was first saved, and
    ``peak_per_module`` is the split of ``peak_bytes`` at the moment of the peak (storages saved
    outside any tracked module, including recomputation during backward, under
    ``"<untracked>"``). Tensors that recomputation saves during backward count while they
    live, so a peak reached in backward includes them. Saved tensors still held when the
    context exits keep being followed until they are released.
    """

    def _start(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_per_module: dict[str, int] = {}
        self.live_per_module: dict[str, int] = {}
        self._live: dict[int, list[Any]] = {}  # storage key -> [references, bytes, owner]

    def _pack(self, t: Tensor) -> Any:
        key = _storage_key(t)
        if key in self._excluded:
            return t
        entry = self._live.get(key)
        if entry is None:
            owner = self._owner()
            entry = self._live[key] = [0, t.untyped_storage().nbytes(), owner]
            self.live_bytes += entry[1]
            self.live_per_module[owner] = self.live_per_module.get(owner, 0) + entry[1]
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
                self.peak_per_module = {k: v for k, v in self.live_per_module.items() if v}
        entry[0] += 1
        return _SavedRef(t, self, key)

    def _unpack(self, packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _SavedRef) else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.live_bytes -= entry[1]
            self.live_per_module[entry[2]] -= entry[1]
