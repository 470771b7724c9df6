"""LoRA in a training run: the adapter settings a ``GPTModule`` runs (``model.lora``, or those
of ``model.adapter_from``'s PEFT adapter directory), the adapters it attaches and their
starting weights, and the base model they are trained on, which a checkpoint records and a
resume checks.

``model.adapter_from: DIR`` (``adapter_config.json`` + ``adapter_model.safetensors``, as
``peft`` or ``lightning-sp export --adapter`` writes it) needs ``model.init_from``, the base;
the directory's ``base_model_name_or_path``, when it names a local directory, must be that
base. ``model.lora`` may be left out (the directory's settings are used) or restate them:
``r``, ``lora_alpha`` and ``use_rslora`` must equal the directory's, ``lora_dropout`` is the
run's; the targets must adapt exactly the linears the directory holds adapters for. Every
rank reads its own slices (:func:`~lightning_sp.interop.peft.load_adapter`), in any layout.

A checkpoint of an adapter run records its base (``lora_base``: ``init_from`` and
:func:`~lightning_sp.interop.peft.base_fingerprint`); resuming it onto another base is one
line (:func:`check_base`)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from lightning_sp.errors import ConfigError
from lightning_sp.interop.peft import (
    base_fingerprint,
    check_adapter_base,
    load_adapter,
    read_adapter_config,
)
from lightning_sp.model.config import GPTConfig
from lightning_sp.model.gpt import GPT
from lightning_sp.model.lora import LoRAConfig, apply_lora, check_lora

STATED = ("r", "lora_alpha", "use_rslora")
"""The settings ``model.lora`` must share with ``model.adapter_from``'s directory (they fix
what its weights mean); ``lora_dropout`` is the run's own."""


def first_difference(stated: LoRAConfig, saved: LoRAConfig) -> tuple[str, Any, Any] | None:
    """The first of the :data:`STATED` settings in which a run's adapters (``stated``) differ
    from saved ones (an adapter directory's, a checkpoint's): ``(name, stated value, saved
    value)``; None where they agree. Each caller words its own error."""
    return next(
        ((name, getattr(stated, name), getattr(saved, name)) for name in STATED
         if getattr(stated, name) != getattr(saved, name)),
        None,
    )  # fmt: skip


def adapter_settings(
    lora: LoRAConfig | None, adapter_from: str | None, init_from: str | None, config: GPTConfig
) -> LoRAConfig | None:
    """The run's adapter settings (None: a full fine-tune), checked before any work, one
    :class:`ConfigError` line for: a bad setting or target, ``adapter_from`` without
    ``init_from``, an adapter directory whose base is not ``init_from``, ``model.lora`` stating
    another ``r`` / ``lora_alpha`` / ``use_rslora`` than the directory's."""
    if adapter_from is not None:
        theirs = read_adapter_config(adapter_from)
        if init_from is None:
            raise ConfigError(
                f"adapter_from={adapter_from!r} needs init_from, the base model directory its "
                "adapters were trained on"
            )
        check_adapter_base(adapter_from, init_from)
        if lora is None:
            lora = theirs
        if difference := first_difference(lora, theirs):
            name, ours, stated = difference
            raise ConfigError(
                f"lora.{name}={ours!r} differs from adapter_from={adapter_from!r}, whose "
                f"adapters have {name}={stated!r}; leave model.lora out or set {name}: {stated!r}"
            )
    if lora is not None:
        check_lora(lora, config)
    return lora


def attach_adapters(
    chunks: Iterable[GPT], lora: LoRAConfig, adapter_from: str | None, config: GPTConfig
) -> None:
    """Freeze each chunk's weights and attach ``lora``'s adapters (``peft``'s initialisation:
    :func:`~lightning_sp.model.lora.apply_lora`), then, with ``adapter_from``, set them to
    that directory's (this rank's slices)."""
    for chunk in chunks:
        apply_lora(chunk, lora)
        if adapter_from is not None:
            load_adapter(chunk, adapter_from, config)


@functools.lru_cache(maxsize=4)
def base_record(init_from: str | None) -> dict[str, Any]:
    """What a checkpoint of an adapter run records of its base: ``init_from`` and its
    :func:`~lightning_sp.interop.peft.base_fingerprint` (None for a seeded base); computed
    once per process (every checkpoint of a run records the same)."""
    fingerprint = base_fingerprint(init_from) if init_from is not None else None
    return {"init_from": init_from, "sha256": fingerprint}


def check_base(saved: dict[str, Any] | None, init_from: str | None) -> None:
    """A checkpoint's adapters (``saved``: its :func:`base_record`; None for a full
    fine-tune's) resume only onto the base they were trained on (``init_from`` has the same
    fingerprint): one :class:`ConfigError` line otherwise."""
    if not saved:
        return
    current = base_record(init_from)
    if saved.get("sha256") == current["sha256"]:
        return

    def named(record: dict[str, Any]) -> str:
        digest = record.get("sha256")
        return f"{record.get('init_from')!r} (sha256 {digest[:12] if digest else None})"

    raise ConfigError(
        f"the checkpoint's adapters were trained on the base {named(saved)}, not on "
        f"init_from={named(current)}; resume with model.init_from set to that base"
    )


__all__ = ["adapter_settings", "attach_adapters", "base_record", "check_base"]
