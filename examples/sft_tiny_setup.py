"""Build what ``configs/llama_sft_tiny.yaml`` fine-tunes, locally, in a few seconds (nothing is
downloaded): ``data/sft_tiny/``

* ``tokenizer/``: a Hugging Face tokenizer directory (BPE trained on the corpus, role markers as
  special tokens) whose chat template marks the assistant turns with
  ``{% generation %}`` (so ``apply_chat_template(return_assistant_tokens_mask=True)`` finds them);
* ``base/``: a small random Llama in Hugging Face format with that vocabulary (stands in for a
  downloaded instruct model: point ``model.init_from`` and ``data.chat_template_dir`` at yours);
* ``chat.jsonl``: 2000 conversations (``messages``; some ``prompt`` / ``completion``) of small
  arithmetic questions and answers.

Everything is seeded: two runs write the same bytes (the same base model), so the demo's
figures reproduce and runs of different layouts start from one model.

    python examples/sft_tiny_setup.py && python cli.py fit --config configs/llama_sft_tiny.yaml
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}"
    "{{ '<|' + m['role'] + '|> ' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + ' <|end|>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + ' <|end|>' }}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
           "seventeen", "eighteen"]  # fmt: skip


def conversation(rng: random.Random) -> dict:
    a, b = rng.randrange(10), rng.randrange(10)
    question = f"what is {NUMBERS[a]} plus {NUMBERS[b]} ?"
    answer = f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]} ."
    if rng.random() < 0.3:
        return {"prompt": question, "completion": answer}
    messages = [{"role": "system", "content": "you add numbers ."}] if rng.random() < 0.5 else []
    return {"messages": [*messages, {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}  # fmt: skip


def main(root: Path = Path("data/sft_tiny")) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    rows = [conversation(rng) for _ in range(2000)]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "chat.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [" ".join(NUMBERS) + " what is plus you add numbers ? ."] * 4
    bpe.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<|endoftext|>"])
    )
    (root / "bpe").mkdir(exist_ok=True)
    bpe.save(str(root / "bpe" / "tokenizer.json"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "bpe" / "tokenizer.json"),
                                        eos_token="<|endoftext|>")  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(root / "tokenizer"))
    fields: dict[str, Any] = dict(
        vocab_size=320, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)  # the same base model on every run: figures and layouts compare
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(str(root / "base"))
    print(f"wrote {root}/chat.jsonl ({len(rows)} conversations), {root}/tokenizer, {root}/base")


if __name__ == "__main__":
    main()
