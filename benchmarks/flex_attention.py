"""FlexAttention (``torch.nn.attention.flex_attention``) with a block-causal document mask on
this machine, against our cores (issue 35): does it run eager and under ``torch.compile``, is
it exact against the ``math`` core, and its forward time over ``sdpa``'s per-document calls.

One process; the documents are seeded lengths between 64 and 200 tokens
(:func:`benchmarks.documents.documents_of`). Reported: float64 eager and compiled (error or
max |difference| against ``math``), fp32 compiled, whether backward runs, and the median
ratio of forward times over ``--rounds`` paired rounds with a 95% bootstrap interval.

    python -m benchmarks.flex_attention            # b=2, a=8, s=1024, d=64, 15 rounds

Writes ``flex_attention.json`` and ``flex_attention.md`` (``--out``, ``--smoke``).
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from benchmarks._format import arguments, save, table
from benchmarks._stats import interleaved, ratio_ci
from benchmarks.documents import documents_of
from lightning_sp.model.cores import attention_core, sdpa_core


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = arguments(__doc__, argv, "s=128, 2 rounds", seq=(1024, 128), rounds=(15, 2))
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, heads, s, d = 2, 8, args.seq, 64
    documents = documents_of(b, s, 64, 200, seed=0)

    def same_document(batch: Tensor, head: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return (q >= k) & (documents[batch, q] == documents[batch, k])

    mask = create_block_mask(same_document, B=b, H=None, Q_LEN=s, KV_LEN=s, device="cpu")
    generator = torch.Generator()

    def flex(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q4, k4, v4 = (x.view(b, heads, s, d) for x in (q, k, v))  # [b, a, s, d]
        return fn(q4, k4, v4, block_mask=mask).view(b * heads, 1, s, d)

    def qkv(dtype: torch.dtype, grad: bool = False) -> list[Tensor]:
        return [torch.randn(b * heads, 1, s, d, dtype=dtype, requires_grad=grad) for _ in "qkv"]

    result: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it materialises the scores

        # timed first: dynamo caches per code object, and the failed compilations below
        # (float64, backward) would spend its recompilation limit and leave it eager
        compiled = torch.compile(flex_attention)
        q, k, v = qkv(torch.float32)
        steps = {"flex": lambda: flex(compiled, q, k, v),
                 "sdpa": lambda: sdpa_core(q, k, v, 0.0, generator, False, documents)}  # fmt: skip
        times = interleaved(steps, 3, args.rounds)  # 3 warm-up rounds (compilation)
        for dtype in (torch.float64, torch.float32):
            q, k, v = qkv(dtype)
            reference = attention_core(q, k, v, 0.0, generator, False, documents)
            for name, fn in (
                ("eager", flex_attention),
                ("compiled", torch.compile(flex_attention)),
            ):
                key = f"{name}_{str(dtype).removeprefix('torch.')}"
                try:
                    result[key] = (flex(fn, q, k, v) - reference).abs().max().item()
                except Exception as exc:  # what this torch refuses, reported as such
                    result[key] = _first_line(exc)
        q, k, v = qkv(torch.float32, grad=True)
        try:
            flex(torch.compile(flex_attention), q, k, v).sum().backward()
            result["backward"] = "runs"
        except Exception as exc:
            result["backward"] = _first_line(exc)

    ratio = ratio_ci(times["flex"], times["sdpa"])
    result["flex_over_sdpa_forward"] = [round(x, 3) for x in ratio]
    result["flex_ms"] = round(1e3 * statistics.median(times["flex"]), 1)
    result["sdpa_per_document_ms"] = round(1e3 * statistics.median(times["sdpa"]), 1)
    rows = [[key, value] for key, value in result.items()]
    save(args, argv, "flex_attention", result, table(["measure", "value"], rows), seq=args.seq)
    return result


if __name__ == "__main__":
    main()
