"""What holds a process group that outlived ``destroy_process_group``: the objects that refer
to a live ``ProcessGroup`` (or to its gloo backend), named, for the message of a spawned rank
that failed its release check (:mod:`lightning_sp.testing.spawn`)."""

from __future__ import annotations

import gc
import sys
import types
import warnings
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Backend

HOLDERS = 6
"""How many holders :func:`group_holders` names at most."""


def _is_group(obj: object) -> bool:
    # by its type: isinstance on every referent would run deprecated objects' hooks (warnings)
    return issubclass(type(obj), (dist.ProcessGroup, Backend))


def _items(container: object) -> list[object]:
    if type(container) is tuple:
        return list(container)
    if type(container) is dict:
        return list(container.values())
    return []


def _contains(value: object, group: object, depth: int = 3) -> bool:
    """``value`` is ``group`` or an untracked container holding it, ``depth`` deep."""
    if value is group:
        return True
    return depth > 0 and any(_contains(x, group, depth - 1) for x in _items(value))


def _owner_of(mapping: dict[Any, Any], skip: set[int]) -> str:
    """``mapping`` as what owns it: a module's globals, an object's attributes, or a dict."""
    for owner in gc.get_referrers(mapping):
        if id(owner) in skip:
            continue
        if isinstance(owner, types.ModuleType):
            return f"module {owner.__name__}"
        if getattr(owner, "__dict__", None) is mapping:
            return f"a {type(owner).__qualname__}'s attributes"
    return "a dict"


def _describe(obj: object, group: object, skip: set[int]) -> str:
    if isinstance(obj, types.FrameType):
        return f"the frame of {obj.f_code.co_name} ({obj.f_code.co_filename}:{obj.f_lineno})"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__module__}.{obj.__qualname__} (a default or closure)"
    if isinstance(obj, dict):
        keys = [repr(k)[:40] for k, v in obj.items() if _contains(v, group) or k is group][:3]
        return f"{_owner_of(obj, skip)}, key {', '.join(keys) or '(a nested value)'}"
    if isinstance(obj, types.CellType):
        return "a closure cell"
    kind = f"a {type(obj).__module__}.{type(obj).__qualname__}"
    for mapping in gc.get_referrers(obj):  # where that container is kept, one level up
        if isinstance(mapping, dict) and id(mapping) not in skip:
            keys = [repr(k)[:40] for k, v in mapping.items() if v is obj][:1]
            if keys:
                return f"{kind} in {_owner_of(mapping, skip)}, key {keys[0]}"
    return kind


def group_holders(limit: int = HOLDERS) -> list[str]:
    """One line per object (at most ``limit``) the garbage collector can see refer to a live
    ``ProcessGroup`` or gloo backend, after a full collection; empty when none does (what
    holds the group is then outside Python's reach: torch's C++ caches, dynamo's guards)."""
    with warnings.catch_warnings():  # deprecated objects of torch's warn when looked at
        warnings.simplefilter("ignore")
        return _holders(limit)


def _holders(limit: int) -> list[str]:
    gc.collect()
    here = sys._getframe()
    skip = {id(here)}
    lines: list[str] = []
    objects = gc.get_objects()
    skip.add(id(objects))
    for obj in objects:
        if len(lines) >= limit:
            break
        if obj is here:
            continue
        try:
            referents = gc.get_referents(obj)
        except Exception:  # an object that cannot list its referents names no group
            continue
        if isinstance(obj, types.FunctionType):  # defaults: a tuple the collector does not track
            referents += [*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        # a tuple or dict of untracked objects is untracked itself: look into those held here
        inner = referents
        for _ in range(3):  # nested untracked containers, three deep
            inner = [x for r in inner if not gc.is_tracked(r) for x in _items(r)]
            referents += inner
        for group in referents:
            if _is_group(group):
                lines.append(_describe(obj, group, skip))
                break
    return lines


__all__ = ["HOLDERS", "group_holders"]
