"""Build the preference pairs ``configs/llama_dpo_tiny.yaml`` trains on, locally and seeded (two
runs write the same bytes): ``data/dpo_tiny/pairs.jsonl``, 1000 pairs in TRL's conversational
format: a ``prompt`` (the SFT demo's question), a ``chosen`` answer with the right sum and a
``rejected`` one with a wrong sum, worded as the SFT demo's answers.

The DPO demo continues the SFT demo (``examples/sft_tiny_setup.py``,
``configs/llama_sft_tiny.yaml``) from its export::

    python examples/sft_tiny_setup.py && python cli.py fit --config configs/llama_sft_tiny.yaml
    python cli.py export --ckpt_path checkpoints/llama_sft_tiny/last.ckpt \
        --output data/sft_tiny/export
    python examples/dpo_tiny_setup.py && python cli.py fit --config configs/llama_dpo_tiny.yaml
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]  # fmt: skip


def pair(rng: random.Random) -> dict:
    """One question with a right (chosen) and a wrong (rejected) sum, off by 1 to 3."""
    a, b = rng.randrange(10), rng.randrange(10)
    right = a + b
    wrong = rng.choice([n for n in range(right - 3, right + 4) if n != right and 0 <= n <= 18])
    question = f"what is {NUMBERS[a]} plus {NUMBERS[b]} ?"

    def answer(n: int) -> list[dict[str, str]]:
        return [
            {"role": "assistant", "content": f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[n]} ."}
        ]

    return {"prompt": [{"role": "user", "content": question}],
            "chosen": answer(right), "rejected": answer(wrong)}  # fmt: skip


def main(root: Path = Path("data/dpo_tiny"), n: int = 1000) -> None:
    rng = random.Random(0)
    rows = [pair(rng) for _ in range(n)]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "pairs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {root}/pairs.jsonl ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
