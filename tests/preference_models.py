"""Shared by the DPO tests: preference pairs of token ids, packed into our rows (pairs as
documents, several per row), and TRL 1.16's ``DPOTrainer`` as the reference on the same
transformers models (float64).

TRL's fused LM head computes log-probabilities in fp32 whatever the model's dtype; the
reference replaces it with the same outputs computed from transformers' own float64 logits
(``log_softmax`` and a gather), so what runs is ``DPOTrainer._compute_loss`` on transformers'
logits. RMSNorms run in float64 on both sides (:func:`lora_models.wide_norms`), as the LoRA
tests do, for gradient parity to 1e-10.
"""

from __future__ import annotations

import tempfile
import types
from pathlib import Path
from typing import Any

import torch

from lightning_sp.model.documents import positions_in_documents
from lightning_sp.parallel.vocab import IGNORE_INDEX

from hf_models import SEQ, VOCAB

EOS = 0
Pair = tuple[list[int], list[int], list[int]]  # prompt, chosen, rejected (answers end in EOS)

ROWS = [3, 1, 2, 2]
"""Pairs per row of :func:`pack_rows`' batch: uneven, so a micro-batch, replica or accumulated
batch's own mean differs from the global one."""


def make_pairs(count: int, seed: int = 3) -> list[Pair]:
    """``count`` pairs of random token ids: prompts of 2 tokens, answers of 1-2 tokens plus
    EOS (three pairs fit a row of ``SEQ + 1`` tokens)."""
    g = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    return [(ids(2, 2), [*ids(1, 2), EOS], [*ids(1, 2), EOS]) for _ in range(count)]


def pack_rows(pairs: list[Pair], per_row: list[int] = ROWS) -> dict[str, torch.Tensor]:
    """A preference batch ``[len(per_row), SEQ]``: row ``r`` holds the next ``per_row[r]``
    pairs, each as two documents (prompt + chosen, prompt + rejected; slots ``2j``,
    ``2j + 1``), then one EOS padding document; the fields the data path gives."""
    rows: dict[str, list[torch.Tensor]] = {}
    queue = iter(pairs)
    for count in per_row:
        tokens: list[int] = []
        documents: list[int] = []
        answer: list[int] = []  # the slot of each answer token, else -1
        for j in range(count):
            prompt, chosen, rejected = next(queue)
            for k, reply in enumerate((chosen, rejected)):
                doc = 2 * j + k
                tokens += prompt + reply
                documents += [doc] * (len(prompt) + len(reply))
                answer += [-1] * len(prompt) + [doc] * len(reply)
        pad = SEQ + 1 - len(tokens)
        assert pad > 0, f"{count} pairs do not fit a row of {SEQ + 1} tokens"
        tokens += [EOS] * pad
        documents += [2 * count] * pad
        answer += [-1] * pad
        row, doc, ans = (torch.tensor(x) for x in (tokens, documents, answer))
        same = doc[1:] == doc[:-1]
        slots = torch.where(same & (ans[1:] >= 0), ans[1:], -1)
        sample = {
            "input_ids": row[:-1], "labels": row[1:], "loss_mask": slots >= 0,
            "documents": doc[:-1].to(torch.int32), "sequences": slots,
        }  # fmt: skip
        sample["positions"] = positions_in_documents(sample["documents"])
        for key, value in sample.items():
            rows.setdefault(key, []).append(value)
    return {key: torch.stack(values) for key, values in rows.items()}


def _float64_head(model: Any, record: list[torch.Tensor]) -> None:
    """``model(..., fused_lm_head=True)`` (TRL's call) from transformers' float64 logits; each
    call's per-token log-probabilities appended to ``record``."""
    from trl.trainer.utils import FusedCausalLMOutput

    forward = type(model).forward

    def fused(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None,
              **kwargs: Any) -> Any:  # fmt: skip
        kwargs.pop("shift_labels", None), kwargs.pop("num_items_in_batch", None)
        out = forward(self, *args, **kwargs)
        if not fused_lm_head:
            return out
        logits, target = out.logits[:, :-1], labels[:, 1:]
        mask = target != IGNORE_INDEX
        logp = logits.log_softmax(-1)
        picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        log_probs = picked.masked_fill(~mask, 0.0)
        record.append(log_probs.detach())
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0.0)
        top1 = logits.argmax(-1) == target
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / mask.sum(), log_probs=log_probs, entropy=entropy,
            log_sum_sq_probs=None, mean_logits=logits.mean(-1), is_top1=top1 & mask,
            label_mask=mask, aux_loss=None,
        )  # fmt: skip

    model.forward = types.MethodType(fused, model)


def trl_reference(
    policy_dir: Path, reference_dir: Path, pairs: list[Pair], settings: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For each of ``settings`` (``loss_type``, ``beta``, ``label_smoothing``): TRL's loss,
    metrics, per-sequence log-probabilities (policy and reference) and the policy's gradients
    by Hugging Face name, on ``pairs`` in one batch (float64, norms in float64)."""
    import transformers
    from datasets import Dataset
    from lora_models import widen_hf_norms
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import DPOConfig, DPOTrainer

    def load(directory: Path) -> Any:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="sdpa"
        )
        model = model.double()
        widen_hf_norms(model)
        return model

    policy, reference = load(policy_dir), load(reference_dir)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token=f"t{EOS}", pad_token=f"t{EOS}"
    )

    def text(ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)

    rows = [{"prompt": text(p), "chosen": " " + text(c), "rejected": " " + text(r)}
            for p, c, r in pairs]  # fmt: skip
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, bf16=False, fp16=False,
        max_length=None, per_device_train_batch_size=len(pairs),
    )  # fmt: skip
    data = Dataset.from_list(rows)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=data,
                         processing_class=tokenizer)  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    for i, (prompt, chosen, rejected) in enumerate(pairs):  # the same sequences as ours
        for row, reply in ((i, chosen), (i + len(pairs), rejected)):
            n = len(prompt) + len(reply)
            assert batch["input_ids"][row, :n].tolist() == prompt + reply, "TRL's tokens differ"
    results = []
    for setting in settings:
        record: list[torch.Tensor] = []
        _float64_head(trainer.model, record)
        _float64_head(trainer.ref_model, record)
        trainer.loss_types = [setting["loss_type"]]
        trainer.beta = setting["beta"]
        trainer.label_smoothing = setting.get("label_smoothing", 0.0)
        trainer._metrics["train"].clear()
        trainer.model.zero_grad(set_to_none=True)
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        logps, ref_logps = (x.sum(1) for x in record)  # [2N]: chosen rows, then rejected
        metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
        results.append({"loss": loss.detach(), "metrics": metrics, "logps": logps,
                        "ref_logps": ref_logps, "grads": grads})  # fmt: skip
    return results


__all__ = ["EOS", "ROWS", "make_pairs", "pack_rows", "trl_reference"]
