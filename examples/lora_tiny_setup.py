"""Build the model ``configs/qwen3_lora_tiny.yaml`` fine-tunes with LoRA, locally, in seconds
(nothing is downloaded): ``data/lora_tiny/base``, a small random Qwen3 in Hugging Face format
written by transformers (``Qwen3ForCausalLM.save_pretrained``), seeded: two runs write the
same bytes (the script prints the files' SHA-256). It stands in for a downloaded model: the
config names no size, ``model.init_from`` alone gives the architecture.

    python examples/lora_tiny_setup.py
    python cli.py fit --config configs/qwen3_lora_tiny.yaml
    python cli.py export --ckpt_path checkpoints/qwen3_lora_tiny/last.ckpt \\
        --adapter data/lora_tiny/adapter        # a PEFT adapter directory
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

QWEN3: dict[str, Any] = dict(
    vocab_size=257,            # the byte-level tokenizer: 256 bytes + end of document
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=24,               # Qwen3's head dimension, not h/a = 16
    intermediate_size=176, max_position_embeddings=128, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
)  # fmt: skip
"""The base model's ``config.json`` sizes."""


def digest(directory: Path) -> str:
    """SHA-256 over the directory's files (names and bytes, in name order)."""
    sha = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        sha.update(path.name.encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def main(root: Path = Path("data/lora_tiny")) -> Path:
    """Write ``root/base`` (seeded; the same bytes every run) and return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3))
    with torch.no_grad():  # norms away from 1, so that every weight matters
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.02)
    base = root / "base"
    model.save_pretrained(str(base))
    print(f"wrote {base} (sha256 {digest(base)[:16]})")
    return base


if __name__ == "__main__":
    main()
