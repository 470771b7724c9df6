"""Plant each known bug in the package, run the tests that must catch it, and put it back.

    python tests/mutations/run.py                 # every mutation, one after another
    python tests/mutations/run.py padded_vocab    # some, by name
    python tests/mutations/run.py --list

A mutation is a few exact text replacements in tracked files; each must match exactly once
(so a refactor that moves the code makes the mutation fail loudly, to be updated, rather than
silently test nothing). The files are restored after every mutation, also on Ctrl-C. A mutation
is *caught* when its tests fail and their output matches ``expect``: the message that names
the bug. Prints one markdown table row per mutation (the table in tests/README.md); exits 1 if
any mutation survives. Not collected by pytest; slow (multi-rank spawns): run it by hand after
changing what these tests cover.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    bug: str
    edits: tuple[tuple[str, str, str], ...]  # (path, exact old text, new text)
    tests: tuple[str, ...]  # pytest arguments
    expect: str  # regex the failing output must match: the message that names the bug


MUTATIONS = (
    Mutation(
        "sp_linear_saves_gathered",
        "SP column-parallel linear saves the all-gathered input instead of its sequence shard",
        (
            (
                "lightning_sp/parallel/layers.py",
                "        ctx.save_for_backward(x, weight)\n"
                "        full = all_gather_sequence(x, group) if sequence_parallel else x",
                "        full = all_gather_sequence(x, group) if sequence_parallel else x\n"
                "        ctx.save_for_backward(full, weight)",
            ),
            (
                "lightning_sp/parallel/layers.py",
                "            full = all_gather_sequence(x, group) if ctx.sequence_parallel else x",
                "            full = x",
            ),
        ),
        ("tests/test_activation_bytes.py", "-k", "t2-tensor_sequence_parallel_selective"),
        r"measured 19\.\d+ sbh, Table 2 says 17\.0000 sbh",
    ),
    Mutation(
        "skip_sp_grad_allreduce",
        "SP LayerNorm / row-parallel bias / position gradients not summed over TP",
        (
            (
                "lightning_sp/parallel/grads.py",
                "    if grads:\n        _all_reduce_coalesced(grads, state.tp_group",
                "    if grads and False:\n        _all_reduce_coalesced(grads, state.tp_group",
            ),
        ),
        ("tests/test_grads.py",),
        r"(ln\d|bias|position_embeddings)\S*: gradient relative error",
    ),
    Mutation(
        "recompute_no_rng_replay",
        "recompute re-runs the forward without rewinding the dropout streams",
        (
            (
                "lightning_sp/model/recompute.py",
                "        ctx.rng.set_state(ctx.rng_state)\n",
                "",
            ),
        ),
        ("tests/test_random.py::test_dropout_masks_come_from_the_right_stream_and_replay",),
        r"dropout mask recomputed in backward differs from the forward's",
    ),
    Mutation(
        "no_tied_embedding_sum",
        "pipeline: the two copies of the tied embedding do not sum their gradients",
        (
            (
                "lightning_sp/pipeline/stages.py",
                "        dist.all_reduce(grad, group=self._embedding_group)",
                "        pass",
            ),
        ),
        ("tests/test_pipeline.py", "-k", "matches_single_process_float64 and t1-p2-m1-d1"),
        r"word_embeddings\.weight: gradient relative error",
    ),
    Mutation(
        "norm_counts_replicas",
        "global gradient norm counts TP-replicated parameters on every TP rank",
        (
            (
                "lightning_sp/parallel/grads.py",
                "or state.tensor_parallel_rank == 0",
                "or True",
            ),
        ),
        ("tests/test_grads.py",),
        r"global gradient norm differs from the reference",
    ),
    Mutation(
        "no_sampler_skip",
        "resumed sampler does not skip the samples already trained on",
        (
            (
                "lightning_sp/training/data/sampler.py",
                "            start = min(self._resume[",
                "            start = 0 * min(self._resume[",
            ),
        ),
        ("tests/test_data_order.py", "-k", "resumes_mid_epoch"),
        r"assert list\(resumed\) == whole\[10:\]",
    ),
    Mutation(
        "interleaved_chunk_order",
        "interleaved pipeline: chunk c of rank r holds virtual stage r·m + c, not c·p + r",
        (
            (
                "lightning_sp/pipeline/split.py",
                "range((c * p + rank) * per_chunk, (c * p + rank + 1) * per_chunk)",
                "range((rank * m + c) * per_chunk, (rank * m + c + 1) * per_chunk)",
            ),
        ),
        (
            "tests/test_pipeline.py",
            "-k",
            "chunk_layout_is_megatron or (matches_single_process_float64 and t1-p2)",
        ),
        r"AssertionError: \(t, p, m, dp\)=\(1, 2, 2, 1\).*",
    ),
    Mutation(
        "g_backward_not_reduce_scatter",
        "g (all-gather along s) has a split, not a reduce-scatter, as its backward",
        (
            (
                "lightning_sp/parallel/comm.py",
                '_G = _conjugate_op("G", all_gather_sequence, reduce_scatter_sequence)',
                '_G = _conjugate_op("G", all_gather_sequence, split_sequence)',
            ),
        ),
        ("tests/test_comm.py", "-k", "ops_are_adjoint and 2"),
        r"\bg is not adjoint",
    ),
    Mutation(
        "attention_dropout_replicated",
        "attention-probability dropout draws from the replicated stream (same mask on every "
        "TP rank's different heads)",
        (
            (
                "lightning_sp/model/attention.py",
                "self.dropout_p, self.rng.sharded, self.training",
                "self.dropout_p, self.rng.replicated, self.training",
            ),
        ),
        ("tests/test_random.py::test_dropout_masks_come_from_the_right_stream_and_replay",),
        r"attention dropout draws from the replicated stream, expected the sharded stream",
    ),
    Mutation(
        "padded_vocab_unmasked",
        "vocab-parallel cross entropy gives the padded vocabulary columns probability",
        (("lightning_sp/parallel/layers.py", "exp[..., max(padding, 0) :] = 0.0", "pass"),),
        ("tests/test_layers.py", "-k", "one_process"),
        r"padded logit columns 300\.\.383 got probability",
    ),
    Mutation(
        "missing_residual_mask",
        "one 1-byte dropout mask per layer missing (the MLP residual dropout dropped)",
        (
            (
                "lightning_sp/model/gpt.py",
                "return x + self._drop(self.mlp(self.ln2(x), recompute_act=self.recompute_act))",
                "return x + self.mlp(self.ln2(x), recompute_act=self.recompute_act)",
            ),
        ),
        ("tests/test_pipeline.py", "-k", "first_stage_peak_activations and t1-p2-m1"),
        r"layers hold 3\.88\d+ layers' worth at the peak",
    ),
    Mutation(
        "tracker_counts_views_twice",
        "SavedTensorTracker counts every view of a storage (Q, K, V) again",
        (
            (
                "lightning_sp/memory/saved.py",
                "if key in self._excluded or key in self._seen:",
                "if key in self._excluded:",
            ),
        ),
        ("tests/test_saved.py",),
        r"views of one storage counted more than once",
    ),
    Mutation(
        "tracker_counts_parameters",
        "SavedTensorTracker counts parameters' storages as activations",
        (
            (
                "lightning_sp/memory/saved.py",
                "if key in self._excluded or key in self._seen:",
                "if key in self._seen:",
            ),
        ),
        ("tests/test_saved.py",),
        r"parameters counted as activations",
    ),
    Mutation(
        "zero_chunks_at_local_offsets",
        "distributed-optimizer checkpoint chunks are written at their offsets in the local "
        "shard, not in the full tensor",
        (
            (
                "lightning_sp/training/checkpoint/shards.py",
                "at = tuple(b + o for b, o in zip(base, offsets, strict=True))",
                "at = tuple(offsets)",
            ),
        ),
        ("tests/test_distributed_optimizer.py",),
        r"differs|validate global plan",
    ),
    Mutation(
        "zero_masters_not_from_weights",
        "after a load, the distributed optimizer keeps its old fp32 masters of full-precision "
        "weights instead of the loaded weights",
        (
            (
                "lightning_sp/training/checkpoint/checkpointer.py",
                "optimizer.masters_from_weights()",
                "pass",
            ),
        ),
        ("tests/test_distributed_optimizer.py",),
        r"is not the loaded weight",
    ),
    Mutation(
        "sdpa_dropout_global_rng",
        "SDPA's attention dropout draws from torch's global RNG, not the stream it is given",
        (
            (
                "lightning_sp/parallel/random.py",
                "    default.set_state(generator.get_state())\n",
                "",
            ),
        ),
        ("tests/test_attention.py", "-k", "sdpa_dropout"),
        r"does not draw from the stream given",
    ),
    Mutation(
        "guard_decides_per_rank",
        "the non-finite guard decides on each rank's own flags without exchanging them: with a "
        "gradient infinite on one rank only, one rank stops (or skips) and the others step",
        (
            (
                "lightning_sp/runtime/guard.py",
                "world = dist.get_world_size() if dist.is_available() and dist.is_initialized() "
                "else 1",
                "world = 1",
            ),
        ),
        ("tests/test_guard.py",),
        r"ranks disagree on the non-finite guard",
    ),
    Mutation(
        "zero_clips_by_local_norm",
        "under the distributed optimizer a Trainer run clips by this rank's shard's gradient "
        "norm and logs rank 0's as train/grad_norm",
        (
            (
                "lightning_sp/training/gpt_module.py",
                "sharded = buffer is not None and buffer.distributed",
                "sharded = False",
            ),
        ),
        ("tests/test_clipping.py",),
        r"the distributed optimizer logged train/grad_norm .* \(not the global norm\)",
    ),
)


def _apply(mutation: Mutation) -> dict[Path, str]:
    originals: dict[Path, str] = {}
    for path, old, new in mutation.edits:
        file = ROOT / path
        current = file.read_text()
        originals.setdefault(file, current)
        if current.count(old) != 1:
            raise SystemExit(f"{mutation.name}: {path} holds {old!r} {current.count(old)} times")
        file.write_text(current.replace(old, new))
    return originals


def run(mutation: Mutation) -> tuple[bool, list[str], str, float]:
    """Plant, test, restore: (caught, failed tests, the matching line, seconds)."""
    originals = _apply(mutation)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        for file, text in originals.items():
            file.write_text(text)
    output = proc.stdout + proc.stderr
    failed = re.findall(r"^FAILED (\S+)", output, re.MULTILINE)
    lines = [
        line.strip() for line in output.splitlines() if re.search(mutation.expect, line)
    ]  # the assertion's own line ("E   ...") rather than its source in the traceback
    lines.sort(key=lambda line: not line.startswith("E "))
    line = re.sub(r"^E\s+", "", lines[0]) if lines else ""
    return proc.returncode != 0 and bool(lines), failed, line, time.monotonic() - start


def main(argv: list[str]) -> int:
    if argv == ["--list"]:
        for m in MUTATIONS:
            print(f"{m.name}: {m.bug}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    survived = []
    print("| mutation | command | failing tests | message |")
    print("| --- | --- | --- | --- |")
    for m in chosen:
        caught, failed, line, seconds = run(m)
        command = "python -m pytest " + " ".join(f'"{a}"' if " " in a else a for a in m.tests)
        names = "<br>".join(f.split("::", 1)[-1] for f in failed) or "none"
        verdict = line if caught else f"**NOT CAUGHT** ({seconds:.0f} s)"
        print(f"| `{m.name}`: {m.bug} | `{command}` | {names} | {verdict[:200]} |", flush=True)
        if not caught:
            survived.append(m.name)
    if survived:
        print(f"survived: {', '.join(survived)}", file=sys.stderr)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
