"""Plant each known bug in the package, run the tests that must catch it, and put it back.

    python tests/mutations/run.py                 # every mutation, one after another
    python tests/mutations/run.py padded_vocab    # some, by name
    python tests/mutations/run.py --list

A mutation is a few exact text replacements in tracked files; each must match exactly once
(so a refactor that moves the code makes the mutation fail loudly, to be updated, rather than
silently test nothing): such a *stale* entry is reported as its row, **STALE**, and the runner
goes on with the others. The files are restored after every mutation, also on Ctrl-C. A
mutation is *caught* when its tests fail and their output matches ``expect``: the message that
names the bug; its tests run at most ``TIMEOUT`` seconds. Prints one markdown table row per
mutation (the table in tests/README.md); exits 1 if any mutation survives, is stale or timed
out. Not collected by pytest; slow (multi-rank spawns): run it by hand after
changing what these tests cover.
"""

from __future__ import annotations

import re
import signal
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
                "        ctx.save_for_backward(kept, norm_weight, norm_bias, *saved, *weights)\n",
                "        ctx.save_for_backward(kept, norm_weight, norm_bias, *saved, *weights, "
                "full)\n",
            ),
            (
                "lightning_sp/parallel/layers.py",
                "        x, norm_weight, norm_bias, *rest = ctx.saved_tensors\n",
                "        x, norm_weight, norm_bias, *rest, _ = ctx.saved_tensors\n",
            ),
        ),
        ("tests/test_activation_bytes.py", "-k", "t2-tensor_sequence_parallel_selective"),
        r"tensor_sequence_parallel_selective: measured \d+\.\d+ sbh, formula \d+\.\d+ \+ "
        r"LayerNorm statistics",
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
                "        return state.tensor_parallel_rank % shard.replicas == 0\n"
                "    return state.tensor_parallel_rank == 0",
                "        return state.tensor_parallel_rank % shard.replicas == 0\n    return True",
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
                "lightning_sp/data/sampler.py",
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
        "g (all-gather along s before a column-parallel linear) has a split, not a "
        "reduce-scatter, as its backward",
        (
            (
                "lightning_sp/parallel/layers.py",
                "grad_y = reduce_scatter_sequence(grad_full, group) if sp else",
                "grad_y = split_sequence(grad_full, group) if sp else",
            ),
            (
                "lightning_sp/parallel/layers.py",
                "    reduce_scatter_sequence,\n)",
                "    reduce_scatter_sequence,\n    split_sequence,\n)",
            ),
        ),
        ("tests/test_parity.py", "-k", "layouts_match_single_process_float64 and 2"),
        r"gradient relative error",
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
        (("lightning_sp/parallel/vocab.py", "exp[..., max(padding, 0) :] = 0.0", "pass"),),
        ("tests/test_vocab.py", "-k", "one_process"),
        r"padded logit columns 300\.\.383 got probability",
    ),
    Mutation(
        "missing_residual_mask",
        "one 1-byte dropout mask per layer missing (the MLP residual dropout dropped)",
        (
            (
                "lightning_sp/model/gpt.py",
                "x = x + self._drop(y)  # [s/t or s, b, h]",
                "x = x + (y if sub is self.block.sublayers[-1] else self._drop(y))",
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
                "lightning_sp/checkpoint/shards.py",
                "at = tuple(b + low - w for b, low, w in zip(base, lo, within, strict=True))",
                "at = tuple(low - w for b, low, w in zip(base, lo, within, strict=True))",
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
                "lightning_sp/checkpoint/checkpointer.py",
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
                "lightning_sp/training/optimizer_hooks.py",
                "flat, sharded = self._clipped[1], buffer is not None and buffer.distributed",
                "flat, sharded = self._clipped[1], False",
            ),
        ),
        ("tests/test_clipping.py",),
        r"the distributed optimizer logged train/grad_norm .* \(not the global norm\)",
    ),
    # -- issue 32: bugs planted in the newest code that the quick tier did not catch ----------
    Mutation(
        "norm_counts_kv_replicas",
        "global gradient norm counts a key/value head replicated over TP ranks (g < t) once "
        "per replica",
        (
            (
                "lightning_sp/parallel/grads.py",
                "        return state.tensor_parallel_rank % shard.replicas == 0\n",
                "        return True\n",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"global gradient norm differs from one process's",
    ),
    Mutation(
        "finalize_loses_kv_sum",
        "finalize_grads does not sum the gradient of key/value heads replicated over TP ranks",
        (
            (
                "lightning_sp/parallel/grads.py",
                "    allreduce_replicated_grads(module, state)\n    if buffer is None:",
                "    if buffer is None:",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"finalize_grads \S+: gradient relative error",
    ),
    Mutation(
        "steptime_dp_over_d",
        "step-time model: the gradient all-reduce priced over the d data-parallel ranks instead "
        "of the d·c ranks of dp x cp",
        (
            (
                "lightning_sp/planner/steptime.py",
                "groups = ((params - experts, d * c), (experts, d * c // e))",
                "groups = ((params - experts, d), (experts, d * c // e))",
            ),
        ),
        ("tests/test_steptime_context.py", "-k", "d_times_c"),
        r"gradient all-reduce: .* exposed, over d·c = 8 ranks",
    ),
    Mutation(
        "planner_zero_over_dp",
        "planner: the distributed optimizer's shards over the d data-parallel ranks only, not "
        "dp x cp",
        (
            (
                "lightning_sp/planner/rows.py",
                "    return layout.data_parallel_size * layout.context_parallel_size\n",
                "    return layout.data_parallel_size\n",
            ),
        ),
        ("tests/test_steptime_context.py", "-k", "d_times_c"),
        r"distributed optimizer at d=4, c=2: \d+ B of model state per rank",
    ),
    Mutation(
        "cp_mean_of_means",
        "context parallelism: the token mean taken as the mean of the ranks' own means",
        (
            (
                "lightning_sp/parallel/context.py",
                "    return f_bar(loss_sum, group) / count.clamp(min=1)",
                "    return f_bar(loss_sum / num_tokens, group) / group_size(group)",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"the mean over every token of unequal counts is 0\.625",
    ),
    Mutation(
        "cp_dropout_redrawn",
        "context parallelism: the CP core's backward replays its forward with fresh dropout masks",
        (
            (
                "lightning_sp/parallel/context_attention.py",
                "            replay.set_state(rng_state[0])\n",
                "",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"backward does not differentiate the forward's masks",
    ),
    Mutation(
        "rmsnorm_bf16_statistics",
        "RMSNorm computes its statistics in the activation dtype (bf16), not fp32",
        (
            (
                "lightning_sp/model/ops.py",
                "        x32 = x.float()\n        rstd = torch.rsqrt(",
                "        x32 = x\n        rstd = torch.rsqrt(",
            ),
        ),
        ("tests/test_norm_precision.py",),
        r"statistics not in fp32",
    ),
    Mutation(
        "save_outcome_not_agreed",
        "a checkpoint save's outcome is not agreed across ranks: a failure only rank 0 sees "
        "(its publishing rename) is raised on rank 0 alone",
        (
            (
                "lightning_sp/checkpoint/checkpointer.py",
                "            _raise_for(_first_error(error))  # also: the name is published",
                "            _raise_for(error)  # also: the name is published",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"the outcome was not agreed across ranks",
    ),
    Mutation(
        "sigterm_twice_exits_unsaved",
        "a scheduler's SIGTERM to every rank plus the launcher's copy of it count as two: the "
        "second stops the rank at once, unsaved",
        (
            (
                "lightning_sp/runtime/shutdown.py",
                "SAME_STOP_SECONDS = 2.0\n",
                "SAME_STOP_SECONDS = 0.0\n",
            ),
        ),
        ("tests/test_shutdown.py", "-k", "same_stop"),
        r"SystemExit",
    ),
    Mutation(
        "router_bias_not_saved",
        "checkpoints hold no persistent buffers: a resumed MoE run restarts its router biases "
        "at zero",
        (
            (
                "lightning_sp/checkpoint/shards.py",
                "            if name in persistent:\n",
                "            if False:\n",
            ),
        ),
        ("tests/test_moe_state.py", "-k", "hold_router_biases"),
        r"persistent buffers are not saved",
    ),
    Mutation(
        "chat_answerless_kept",
        "chat SFT: conversations without an answer token are packed (they train nothing; a "
        "corpus of them trained at loss 0)",
        (
            (
                "lightning_sp/data/chat.py",
                "            if not loss_tokens(mask):  # it trains nothing",
                "            if False:  # it trains nothing",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "without_an_answer"),
        r"they were not dropped",
    ),
    Mutation(
        "zero_token_step_trains",
        "a step whose global count of loss tokens is 0 steps the optimizer (weight decay on "
        "nothing)",
        (
            (
                "lightning_sp/training/optimizer_hooks.py",
                "        if not tokens:  # the same global count on every rank",
                "        if False:  # the same global count on every rank",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "no_loss_token"),
        r"the optimizer stepped on a step with no loss token",
    ),
    Mutation(
        "shard_ids_unchecked",
        "prepared shards: token ids are not checked against the vocabulary where read (ids "
        "above it train silently)",
        (
            (
                "lightning_sp/data/tokens.py",
                "            if self.vocab_size is not None and piece.size and int(piece.max()) >= "
                "self.vocab_size:",
                "            if False:",
            ),
        ),
        ("tests/test_data_prepare.py", "-k", "outside_the_vocabulary"),
        r"was read without a word \(ids not checked where read\)",
    ),
    Mutation(
        "hf_extra_tensor_ignored",
        "Hugging Face import: a tensor the config has no place for is dropped without a word",
        (
            (
                "lightning_sp/interop/hf.py",
                "            if key in used or IGNORED.search(key):",
                "            if True:",
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "otherwise_fail"),
        r"was dropped without a word",
    ),
    Mutation(
        "hf_rope_both_keys_read",
        "Hugging Face import: a config.json with both rope_parameters and a legacy "
        "rope_scaling is read as rope_parameters (transformers applies rope_scaling)",
        (
            (
                "lightning_sp/interop/hf_config.py",
                '    if hf.get("rope_scaling") and hf.get("rope_parameters"):',
                "    if False:",
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "otherwise_fail"),
        r"legacy rope_scaling was read",
    ),
    Mutation(
        "packing_positions_contiguous",
        "Packing.of_batch cuts the positions into contiguous pieces under context parallelism, "
        "not the load-balanced chunks r and 2c - 1 - r",
        (
            (
                "lightning_sp/model/documents.py",
                "            positions = shard_for_context_parallel(positions, 1, c, r)",
                "            positions = positions.chunk(c, dim=1)[r]",
            ),
        ),
        ("tests/test_documents.py", "-k", "packing_of_batch"),
        r"\(cut contiguously\?\)",
    ),
    Mutation(
        "first_fit_strict",
        "first-fit packing with < for <=: an item that fills a bin's room exactly opens a new bin",
        (
            (
                "lightning_sp/data/packing.py",
                "            if length <= free:",
                "            if length < free:",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "fills_a_bin_exactly"),
        r"fills a bin's room exactly",
    ),
    Mutation(
        "token_mean_per_batch",
        "the token mean starts anew at every batch, not at the step boundary (accumulated "
        "batches are weighted alike whatever their counts)",
        (
            (
                "lightning_sp/training/gpt_module.py",
                "            self._token_mean is None or batch_idx % "
                "self.trainer.accumulate_grad_batches == 0\n        ):",
                "            True\n        ):",
            ),
        ),
        ("tests/test_token_mean.py", "-k", "accumulation"),
        r"the step boundary is not",
    ),
    Mutation(
        "expert_bias_over_dp_only",
        "the auxiliary-loss-free bias update sums the loads over data parallelism only, not "
        "data x context",
        (
            (
                "lightning_sp/model/moe/layer.py",
                "else None, state.gradient_group)",
                "else None, state.dp_group)",
            ),
        ),
        ("tests/test_moe_parallel.py", "-k", "layouts_match_single_process_quick"),
        r"sigmoid_bias: bias",
    ),
    Mutation(
        "step_metrics_per_replica",
        "the step's routing metrics are not summed over the data-parallel replicas",
        (
            (
                "lightning_sp/model/hooks.py",
                "    for group in (state.dp_group, state.pp_group):",
                "    for group in (state.pp_group,):",
            ),
        ),
        ("tests/test_moe_pipeline.py", "-k", "step_metrics_are_global"),
        r"AssertionError: .*step metrics \{",
    ),
    Mutation(
        "release_skips_garbage",
        "exit: the process groups that garbage cycles hold are not freed before the "
        "interpreter finalizes (their gloo workers can abort the process at exit)",
        (
            (
                "lightning_sp/parallel/release.py",
                "        gc.collect()  # groups held by garbage cycles",
                "        pass  # groups held by garbage cycles",
            ),
        ),
        ("tests/test_spawn.py",),
        r"a process group outlived destroy_process_group",
    ),
    Mutation(
        "grad_buffer_hooks_strong",
        "the gradient buffer's hooks hold it strongly: a cycle through C++ keeps it, and its "
        "process groups, alive until the interpreter finalizes",
        (
            (
                "lightning_sp/parallel/buffer.py",
                "register_post_accumulate_grad_hook(hook)",
                "register_post_accumulate_grad_hook(self._on_grad)",
            ),
        ),
        ("tests/test_grad_buffer.py", "-k", "freed_with"),
        r"outlives its last reference",
    ),
    # -- issue 40: MoE bugs no test caught --------------------------------------------------
    Mutation(
        "sigmoid_always_renormalised",
        "a sigmoid router with normalize_top_k: false renormalises its top-k weights anyway",
        (
            (
                "lightning_sp/model/moe/router.py",
                "        if cfg.normalize_top_k:  # softmax or sigmoid alike",
                "        if cfg.normalize_top_k or cfg.score == 'sigmoid':  # softmax or sigmoid "
                "alike",
            ),
        ),
        ("tests/test_moe.py", "-k", "by_hand or does_not_weigh"),
        r"normalize_top_k=false renormalised its top-k weights",
    ),
    Mutation(
        "expert_bias_in_combine_weights",
        "the auxiliary-loss-free expert bias leaks into the combine weights (not only the choice)",
        (
            (
                "lightning_sp/model/moe/router.py",
                "        weights = scores.gather(1, experts)\n",
                "        bias = 0 if self.expert_bias is None else self.expert_bias\n"
                "        weights = (scores + bias).gather(1, experts)\n",
            ),
        ),
        ("tests/test_moe.py", "-k", "does_not_weigh"),
        r"the expert bias leaks into the combine weights",
    ),
    Mutation(
        "aux_not_over_microbatches",
        "the auxiliary losses' gradient is not divided by the pipeline's micro-batches",
        (
            (
                "lightning_sp/pipeline/stages.py",
                "scale_auxiliary_losses(self.chunks, 1 / num_microbatches)",
                "scale_auxiliary_losses(self.chunks, 1.0)",
            ),
        ),
        ("tests/test_moe_loss_scale.py", "-k", "micro_batches"),
        r"auxiliary losses' gradient is not divided by n=2 micro-batches",
    ),
    Mutation(
        "aux_not_over_accumulation",
        "the auxiliary losses' gradient is not divided by Lightning's accumulate_grad_batches",
        (
            (
                "lightning_sp/training/checkpoint_hooks.py",
                "1 / (pipeline.num_microbatches * accumulate)",
                "1 / pipeline.num_microbatches",
            ),
        ),
        ("tests/test_moe_loss_scale.py", "-k", "accumulate_grad_batches"),
        r"not divided by accumulate_grad_batches=2",
    ),
    Mutation(
        "sft_aux_not_rescaled",
        "with per-token loss masks the auxiliary losses are divided by the step's token count "
        "with the loss (not rescaled to the micro-batches' mean)",
        (
            (
                "lightning_sp/training/batches.py",
                "per_micro_batch = float(count) / (",
                "per_micro_batch = 1.0 / (",
            ),
        ),
        ("tests/test_moe_loss_scale.py", "-k", "sft"),
        r"with loss masks the auxiliary losses are not",
    ),
    Mutation(
        "sft_aux_count_per_replica",
        "with per-token loss masks the auxiliary losses are rescaled by this replica's token "
        "count, not the global one",
        (
            (
                "lightning_sp/training/batches.py",
                "    if state.dp_group is not None:\n        torch.distributed.all_reduce(count",
                "    if False:\n        torch.distributed.all_reduce(count",
            ),
        ),
        ("tests/test_moe_loss_scale.py", "-k", "sft"),
        r"with loss masks the auxiliary losses are not",
    ),
    Mutation(
        "prelaunch_drops_expert_tp",
        "the pre-launch check builds the layout without expert_tensor_parallel_size",
        (
            (
                "lightning_sp/training/checks.py",
                'if f.name != "data_parallel_size"}',
                'if f.name not in ("data_parallel_size", "expert_tensor_parallel_size")}',
            ),
        ),
        ("tests/test_moe_messages.py", "-k", "before_launch"),
        r"the pre-launch check dropped expert_tensor_parallel_size",
    ),
    # -- issue 44: the fit step's host reads, FP8's agreed scales ------------------------------
    Mutation(
        "resume_check_skips_moe",
        "the resume check compares every architecture field but moe: a checkpoint of another "
        "num_experts or top_k is accepted",
        (
            (
                "lightning_sp/model/architecture.py",
                "            if mine == theirs:\n                continue\n",
                '            if mine == theirs or f.name == "moe":\n                continue\n',
            ),
        ),
        ("tests/test_checkpoint_architecture.py", "-k", "another_moe_shape"),
        r"the resume check accepted a checkpoint trained with another moe",
    ),
    Mutation(
        "dense_takes_expert_layout",
        "a dense model takes expert_parallel_size / expert_tensor_parallel_size > 1 without a "
        "word (ignored)",
        (
            (
                "lightning_sp/model/config_checks.py",
                "    else:\n        _check_no_experts(config.feed_forward, layout)\n",
                "",
            ),
        ),
        ("tests/test_config_errors.py", "-k", "dense_model"),
        r"a dense model took expert_parallel_size=2 without a word",
    ),
    Mutation(
        "loss_on_the_bar_every_step",
        "train/loss logged with prog_bar=True again: Lightning reads it to a number at the end "
        "of every step (a host-device synchronisation per step on a GPU)",
        (
            (
                "lightning_sp/training/gpt_module.py",
                'self.log("train/loss", replica_mean(loss, self.parallel_state))',
                'self.log("train/loss", replica_mean(loss, self.parallel_state), prog_bar=True)',
            ),
        ),
        ("tests/test_host_reads.py", "-k", "None"),
        r"step \d+: 2 host reads",
    ),
    Mutation(
        "fp8_amax_not_agreed",
        "FP8 under TP: each rank scales by its own shard's amax (no MAX all-reduce over the group)",
        (
            (
                "lightning_sp/parallel/fp8.py",
                "    if spans and group_size(group) > 1:\n",
                "    if False:\n",
            ),
        ),
        ("tests/test_fp8.py", "-k", "equal_torchao"),
        r"tensorwise \S+: \S+ of the largest value > 0.0001",
    ),
    Mutation(
        "fp8_input_kept_in_bf16",
        "FP8 tensorwise: a row-parallel linear keeps its bf16 input for backward instead of the "
        "float8 cast (the bytes the FP8 formula states are not the bytes kept)",
        (
            (
                "lightning_sp/parallel/fp8_linears.py",
                "        if producer is None and keeps_float8_input(recipe):\n",
                "        if False:\n",
            ),
        ),
        ("tests/test_fp8_bytes.py", "-k", "one_process and llama-none-tensorwise"),
        r"llama-none-tensorwise: measured \d+ bytes \(\S+ sb\), formula",
    ),
    Mutation(
        "lora_rslora_ignored",
        "LoRA: use_rslora is ignored (the update scaled by lora_alpha / r, not "
        "lora_alpha / sqrt(r))",
        (
            (
                "lightning_sp/model/lora.py",
                "        return self.lora_alpha / "
                "(math.sqrt(self.r) if self.use_rslora else self.r)\n",
                "        return self.lora_alpha / self.r\n",
            ),
        ),
        ("tests/test_lora.py", "-k", "rslora"),
        r"use_rslora: loss relative error \S+ against peft's",
    ),
    Mutation(
        "adapter_rslora_unchecked",
        "model.lora with another use_rslora than adapter_from's directory is accepted (its "
        "adapters then scale by another factor than they were trained with)",
        (
            (
                "lightning_sp/training/adapters.py",
                'STATED = ("r", "lora_alpha", "use_rslora")\n',
                'STATED = ("r", "lora_alpha")\n',
            ),
        ),
        ("tests/test_lora_export.py", "-k", "mistakes"),
        r"another use_rslora: accepted without a word",
    ),
    Mutation(
        "peft_export_drops_rslora",
        "a PEFT adapter directory of rank-stabilised adapters says use_rslora: false (peft then "
        "scales them by lora_alpha / r)",
        (
            (
                "lightning_sp/interop/peft.py",
                '        "use_rslora": lora.use_rslora,\n',
                '        "use_rslora": False,\n',
            ),
        ),
        ("tests/test_lora_peft_dir.py", "-k", "rslora"),
        r"adapter_config.json: \{",
    ),
    Mutation(
        "peft_import_drops_rslora",
        "a PEFT adapter directory's use_rslora: true is read as false (its adapters then scale "
        "by lora_alpha / r)",
        (
            (
                "lightning_sp/interop/peft.py",
                '        use_rslora=bool(document.get("use_rslora", False)),\n',
                "        use_rslora=False,\n",
            ),
        ),
        ("tests/test_lora_peft_dir.py", "-k", "rslora"),
        r"read back as LoRAConfig\(",
    ),
    Mutation(
        "dpo_copy_ignores_init_from",
        "DPO's frozen reference copy is the seeded initialisation, not init_from's weights (a "
        "fine-tune from a model directory compares its policy with a random model)",
        (
            (
                "lightning_sp/training/dpo.py",
                "    if init_from is not None:\n        for chunk in reference.chunks:\n",
                "    if False:\n        for chunk in reference.chunks:\n",
            ),
        ),
        ("tests/test_dpo.py", "-k", "copy_reference"),
        r"the reference copy's \S+ is not init_from's",
    ),
    Mutation(
        "chat_first_token_counts",
        "chat SFT: a conversation's first token counts as a loss token (one whose only "
        "assistant token is its first is packed, training nothing)",
        (
            (
                "lightning_sp/data/chat.py",
                "    return sum(1 for m in mask[1:] if m)\n",
                "    return sum(1 for m in mask if m)\n",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "by_hand"),
        r"loss_tokens\(\[1, 0, 0\]\) = 1, not 0: the first token of a conversation is "
        r"nobody's label",
    ),
    Mutation(
        "fit_pair_masks_crossed",
        "preference truncation cuts each answer mask to the other sequence's length (the "
        "flags of every later token in the bin shift)",
        (
            (
                "lightning_sp/data/preference.py",
                "    return (a[:cap_a], ma[:cap_a]), (b[:cap_b], mb[:cap_b])\n",
                "    return (a[:cap_a], ma[:cap_b]), (b[:cap_b], mb[:cap_a])\n",
            ),
        ),
        ("tests/test_preference_data.py", "-k", "fit_pair"),
        r"fit_pair of chosen \d+ \+ rejected \d+ tokens into 11 must keep each sequence's start "
        r"and cut its mask to its own length: got",
    ),
    Mutation(
        "fit_pair_keeps_ends",
        "preference truncation keeps each sequence's end, not its start (the prompt is cut away)",
        (
            (
                "lightning_sp/data/preference.py",
                "    return (a[:cap_a], ma[:cap_a]), (b[:cap_b], mb[:cap_b])\n",
                "    return (a[-cap_a:], ma[-cap_a:]), (b[-cap_b:], mb[-cap_b:])\n",
            ),
        ),
        ("tests/test_preference_data.py", "-k", "fit_pair"),
        r"fit_pair of chosen \d+ \+ rejected \d+ tokens into 11 must keep each sequence's start "
        r"and cut its mask to its own length: got",
    ),
    Mutation(
        "pair_answer_start_longest",
        "preference pairs: the answers start at the longest common prefix of the prompt with "
        "either sequence, not the shortest (TRL's): a chosen answer that merges with the "
        "prompt's last word loses its first token's loss",
        (
            (
                "lightning_sp/data/preference.py",
                "    start = min(_common(head, full) for full in fulls)\n",
                "    start = max(_common(head, full) for full in fulls)\n",
            ),
        ),
        ("tests/test_preference_data.py", "-k", "answer_starts"),
        r"chosen: the answer must start at the shortest common prefix of the prompt with either "
        r"sequence",
    ),
    Mutation(
        "chat_flags_size_unchecked",
        "prepared chat splits: flags.bin's size is not checked against index.json at open (a "
        "cut or missing file shifts or drops the loss masks)",
        (
            (
                "lightning_sp/data/tokens.py",
                "            _check_size(self.flags_file, self.num_tokens, 1)\n",
                "            pass\n",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "flags_file"),
        r"train/flags\.bin cut or missing, and the data module opened the split without a word",
    ),
    Mutation(
        "resume_counts_one_replica",
        "a resumed sampler restarts its count of consumed samples at this replica's own "
        "(not times the data-parallel size): the next checkpoint repeats samples",
        (
            (
                "lightning_sp/data/sampler.py",
                "        self.consumed_samples = start * self.num_replicas\n",
                "        self.consumed_samples = start\n",
            ),
        ),
        ("tests/test_data_order.py", "-k", "counts_every"),
        r"rank \d: resumed at 20 samples of 2 replicas, 5 more each: the next state says \d+ "
        r"consumed samples, not 30",
    ),
    Mutation(
        "quotas_smallest_remainders",
        "blend quotas: the samples left after rounding down go to the smallest remainders, "
        "not the largest",
        (
            (
                "lightning_sp/data/order.py",
                'order = np.argsort(-(exact - base), kind="stable")',
                'order = np.argsort(exact - base, kind="stable")',
            ),
        ),
        ("tests/test_data_order.py", "-k", "quotas"),
        r"quotas\(.*\) = \[.*\], by hand \[.*\]: the samples left after rounding down go to "
        r"the largest remainders",
    ),
    Mutation(
        "chat_truncate_mask_short",
        "chat SFT: a truncated conversation's mask is cut one token shorter than its ids (every "
        "later flag of its bin shifts)",
        (
            (
                "lightning_sp/data/chat.py",
                "                ids, mask = ids[:width], mask[:width]\n",
                "                ids, mask = ids[:width], mask[: width - 1]\n",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "keeps_its_mask"),
        r"train/flags\.bin holds \d+ flags for \d+ tokens: a truncated conversation's mask was "
        r"not cut with its ids",
    ),
    Mutation(
        "packed_split_overlap",
        "packed chat / preference data: the training items include one validation item "
        "(trained on and validated on)",
        (
            (
                "lightning_sp/data/packing.py",
                '"train": sorted(order[n_val:].tolist())',
                '"train": sorted(order[max(0, n_val - 1) :].tolist())',
            ),
        ),
        ("tests/test_chat_data.py", "-k", "split_members"),
        r"split_members\(\d+, [\d.]+\): train .* and val .* do not hold each item exactly once",
    ),
    Mutation(
        "packed_split_no_minimum",
        "packed chat / preference data: a small val_fraction rounds the validation split to "
        "no item (validation on nothing)",
        (
            (
                "lightning_sp/data/packing.py",
                "min(count - 1, max(1, round(val_fraction * count)))",
                "min(count - 1, round(val_fraction * count))",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "split_members"),
        r"split_members\(10, 0\.01\): 0 validation items, not 1",
    ),
    Mutation(
        "resume_skips_any_epoch",
        "a resumed sampler skips the consumed samples of the saved epoch in whatever epoch it "
        "starts (a checkpoint taken as an epoch ended loses the start of the next)",
        (
            (
                "lightning_sp/data/sampler.py",
                'if self._resume is not None and self._resume["epoch"] == self.epoch:',
                "if self._resume is not None:",
            ),
        ),
        ("tests/test_data_order.py", "-k", "own_epoch"),
        r"resumed from a state of epoch 2 \(10 samples consumed\), epoch 3 reads \d+ samples, "
        r"not its 150: the skip applied to another epoch",
    ),
    Mutation(
        "pair_cut_answerless_kept",
        "preference truncation keeps a pair one of whose sequences lost every answer token "
        "(refused only when both did)",
        (
            (
                "lightning_sp/data/preference.py",
                "if not all(sum(mask[1:]) for _, mask in pair):",
                "if not any(sum(mask[1:]) for _, mask in pair):",
            ),
        ),
        ("tests/test_preference_data.py", "-k", "answerless_sequence"),
        r"row 1, truncated to a chosen sequence of its prompt only \(no answer token\), was "
        r"prepared without a word",
    ),
    Mutation(
        "chat_mask_of_inputs",
        "chat SFT: a sample's loss mask is read from the input tokens' flags, not the labels' "
        "(shifted by one: the answer's first label lost, the turn's closing one added)",
        (
            (
                "lightning_sp/data/chat.py",
                '"loss_mask": (flags[1:] & ASSISTANT).ne(0) & same,',
                '"loss_mask": (flags[:-1] & ASSISTANT).ne(0) & same,',
            ),
        ),
        ("tests/test_chat_data.py", "-k", "by_hand"),
        r"loss_mask \[.*\], by hand \[.*\]: label j must count where token j \+ 1 is an "
        r"assistant token of the same conversation",
    ),
    Mutation(
        "chat_mask_across_conversations",
        "chat SFT: a conversation's last token's label (the next conversation's first token) "
        "counts where that token is an assistant token",
        (
            (
                "lightning_sp/data/chat.py",
                '"loss_mask": (flags[1:] & ASSISTANT).ne(0) & same,',
                '"loss_mask": (flags[1:] & ASSISTANT).ne(0),',
            ),
        ),
        ("tests/test_chat_data.py", "-k", "by_hand"),
        r"loss_mask \[.*\], by hand \[.*\]: label j must count where token j \+ 1 is an "
        r"assistant token of the same conversation",
    ),
    Mutation(
        "padding_joins_last_document",
        "packed bins: the padding gets no start flag (it joins the last conversation's "
        "document: attended to, positions running on)",
        (
            (
                "lightning_sp/data/packing.py",
                "            flags[start] = START\n",
                "",
            ),
        ),
        ("tests/test_chat_data.py", "-k", "packing_is_exact"),
        r"a document of tokens .* is neither a conversation nor the padding",
    ),
    Mutation(
        "sampler_advance_one_replica",
        "the sampler's advance counts one replica's samples, not every replica's (a resume on "
        "more than one replica repeats samples)",
        (
            (
                "lightning_sp/data/sampler.py",
                "self.consumed_samples += samples * self.num_replicas",
                "self.consumed_samples += samples",
            ),
        ),
        ("tests/test_data_order.py", "-k", "resumes_mid_epoch"),
        r"10 samples trained on by each of 2 replicas: the state is .*; its consumed_samples "
        r"counts every replica's",
    ),
    Mutation(
        "resume_applied_twice",
        "the resume state is kept after the resumed pass: every later pass over that epoch "
        "skips the samples again",
        (
            (
                "lightning_sp/data/sampler.py",
                "        self._resume = None\n        self.consumed",
                "        self.consumed",
            ),
        ),
        ("tests/test_data_order.py", "-k", "resumes_mid_epoch"),
        r"the pass after the resumed one skips samples again: the resume applied twice",
    ),
    Mutation(
        "epochs_same_shuffle",
        "every pass over a set uses the same permutation (epochs not freshly shuffled)",
        (
            (
                "lightning_sp/data/order.py",
                "perm = Permutation(n, (self.seed, int(k), int(p)))",
                "perm = Permutation(n, (self.seed, int(k), 0))",
            ),
        ),
        ("tests/test_data_order.py", "-k", "fresh_permutations"),
        r"epochs 0 and 1 visit the samples in the same order: a pass not freshly shuffled",
    ),
    Mutation(
        "eod_starts_next_document",
        "packed pretraining samples: an end-of-document token starts the next document "
        "instead of ending its own",
        (
            (
                "lightning_sp/model/documents.py",
                "return (eod.cumsum(-1, dtype=torch.int32) - eod).to(torch.int32)",
                "return eod.cumsum(-1, dtype=torch.int32).to(torch.int32)",
            ),
        ),
        ("tests/test_packed_data.py", "-k", "three_flags"),
        r"documents \[.*\]: an end-of-document token belongs to the document it ends",
    ),
    Mutation(
        "eod_loss_mask_on_labels",
        "eod_mask_loss masks where the label is the end-of-document token, not the input "
        "(the document's last token learns nothing; the EOD learns the next document)",
        (
            (
                "lightning_sp/data/documents.py",
                'sample["loss_mask"] = inputs != eod_id',
                'sample["loss_mask"] = row[1:] != eod_id',
            ),
        ),
        ("tests/test_packed_data.py", "-k", "three_flags"),
        r"loss_mask \[.*\]: masked where the input \(not the label\) is the end-of-document "
        r"token",
    ),
    Mutation(
        "reference_stored_float32",
        "dpo.reference: precomputed stores the reference log-probabilities as float32 (the "
        "stored reference is no longer the live one's float64)",
        (
            (
                "lightning_sp/data/preference.py",
                "np.save(partial, np.asarray(values, dtype=np.float64))",
                "np.save(partial, np.asarray(values, dtype=np.float32))",
            ),
        ),
        ("tests/test_dpo_precomputed.py", "-k", "equals_live"),
        r"train batch 0: the stored reference log-probabilities differ from the live "
        r"reference's",
    ),
    Mutation(
        "vocabulary_size_id_read",
        "prepared shards: a token id equal to the vocabulary size passes the check where read "
        "(> for >=)",
        (
            (
                "lightning_sp/data/tokens.py",
                "piece.size and int(piece.max()) >= self.vocab_size:",
                "piece.size and int(piece.max()) > self.vocab_size:",
            ),
        ),
        ("tests/test_data_prepare.py", "-k", "equal_to_the_vocabulary_size"),
        r"token id 257 of a vocabulary of 257 ids \(0 \.\. 256\) was read without a word",
    ),
    Mutation(
        "permutation_walks_past_n",
        "the sample order's cycle walking stops at an image equal to n (> for >=): index n, "
        "outside the data, is visited",
        (
            (
                "lightning_sp/data/order.py",
                "        outside = out >= self.n\n        while",
                "        outside = out > self.n\n        while",
            ),
        ),
        ("tests/test_data_order.py", "-k", "seeded_bijection"),
        r"Permutation\(\d+\) maps \[0, \d+\) onto .*: not a bijection of \[0, n\)",
    ),
    Mutation(
        "fingerprint_size_only",
        "a source file's fingerprint is its size only: a file edited in place to the same size "
        "leaves its prepared corpus reused as up to date (stale tokens trained on)",
        (
            (
                "lightning_sp/data/sources.py",
                "parts.append([entry, stat.st_size, stat.st_mtime_ns])",
                "parts.append([entry, stat.st_size])",
            ),
        ),
        ("tests/test_data_prepare.py", "-k", "not_reused"),
        r"a source file edited to the same size: the prepared corpus was reused as up to date",
    ),
    Mutation(
        "prepared_identity_without_val_fraction",
        "a prepared corpus's identity leaves out val_fraction: one prepared with another "
        "validation split is reused as up to date",
        (
            (
                "lightning_sp/data/prepare.py",
                '        "val_fraction": settings.val_fraction,\n',
                "",
            ),
        ),
        ("tests/test_data_prepare.py", "-k", "not_reused"),
        r"val_fraction 0\.5 for 0\.25: the prepared corpus was reused as up to date",
    ),
    Mutation(
        "capacity_rounds_down",
        "MoE capacity ceil(cf·T·k/E) rounded down: a non-integer capacity keeps one choice per "
        "expert too few",
        (
            (
                "lightning_sp/model/moe/router.py",
                "        capacity = math.ceil(cfg.capacity_factor",
                "        capacity = math.floor(cfg.capacity_factor",
            ),
        ),
        ("tests/test_moe.py", "-k", "capacity"),
        r"the capacity does not round up",
    ),
    Mutation(
        "sigmoid_aux_unnormalised",
        "the load-balancing loss of a sigmoid router takes its raw scores, not each token's "
        "scores normalised to sum 1",
        (
            (
                "lightning_sp/model/moe/router.py",
                '        if self.config.score == "sigmoid":\n'
                "            scores = scores / scores.sum(dim=-1, keepdim=True)\n",
                "",
            ),
        ),
        ("tests/test_moe.py", "-k", "by_hand"),
        r"the sigmoid scores are not normalised per token in the auxiliary loss",
    ),
    Mutation(
        "z_loss_not_squared",
        "the router z-loss is the mean of logsumexp(logits), not of its square",
        (
            (
                "lightning_sp/model/moe/router.py",
                "torch.logsumexp(logits, dim=-1).square().sum()",
                "torch.logsumexp(logits, dim=-1).sum()",
            ),
        ),
        ("tests/test_moe.py", "-k", "by_hand"),
        r"the z-loss is not the mean over tokens of logsumexp\(logits\)²",
    ),
    Mutation(
        "moe_score_unchecked",
        "moe.score is not checked: any value but softmax routes silently as sigmoid",
        (
            (
                "lightning_sp/model/moe/config.py",
                '        if self.score not in ("softmax", "sigmoid"):\n'
                '            raise ConfigError(f"moe.score={self.score!r} is not one of softmax, '
                'sigmoid")\n',
                "",
            ),
        ),
        ("tests/test_moe.py", "-k", "refused_when_built"),
        r"MoEConfig\(\{'score': 'relu'\}\) was accepted",
    ),
    Mutation(
        "moe_shared_count_unchecked",
        "a negative moe.num_shared_experts is accepted (a shared MLP of negative width)",
        (
            (
                "lightning_sp/model/moe/config.py",
                "        if self.num_shared_experts < 0:\n",
                "        if False:\n",
            ),
        ),
        ("tests/test_moe.py", "-k", "refused_when_built"),
        r"MoEConfig\(\{'num_shared_experts': -1\}\) was accepted",
    ),
    Mutation(
        "checkpoint_missing_file_accepted",
        "checkpoint verification skips a data file meta.json lists but the directory lacks (a "
        "lost shard is not named before loading)",
        (
            (
                "lightning_sp/checkpoint/verify.py",
                '            raise ConfigError(f"{shown}: file {file} is missing")\n',
                "            continue\n",
            ),
        ),
        ("tests/test_config_errors.py", "-k", "checkpoint_missing_file"),
        r"check_checkpoint accepted a checkpoint whose data file \S+ is missing",
    ),
    Mutation(
        "expert_load_counted_in_eval",
        "the router counts an eval (validation) forward's choices into tokens_per_expert: "
        "validation tokens move the auxiliary-loss-free biases",
        (
            (
                "lightning_sp/model/moe/router.py",
                "        if self.tokens_per_expert is not None and self.training and not "
                "replaying():\n",
                "        if self.tokens_per_expert is not None and not replaying():\n",
            ),
        ),
        ("tests/test_moe_state.py", "-k", "eval_forward"),
        r"an eval \(validation\) forward added its choices to tokens_per_expert",
    ),
    Mutation(
        "step_totals_counted_in_eval",
        "an MoE layer adds an eval (validation) forward to the step's routing totals (the "
        "logged aux/z losses, drops and loads)",
        (
            (
                "lightning_sp/model/moe/layer.py",
                "        if self.training and not replaying():  # once per micro-batch",
                "        if not replaying():  # once per micro-batch",
            ),
        ),
        ("tests/test_moe_state.py", "-k", "eval_forward"),
        r"an eval \(validation\) forward added to the step's routing totals",
    ),
    Mutation(
        "checkpoint_absolute_link",
        "a checkpoint name is an absolute link to its data: a checkpoint folder copied or moved "
        "whole reads (or loses) the original's data",
        (
            (
                "lightning_sp/checkpoint/commit.py",
                "    os.symlink(data.name, link)",
                "    os.symlink(data.resolve(), link)",
            ),
        ),
        ("tests/test_config_errors.py", "-k", "copied_whole"),
        r"outside its folder: the checkpoint name is an absolute link",
    ),
    Mutation(
        "replicated_moments_ignore_expert_slice",
        "the replicated optimizer saves each block of an expert-tensor-parallel [gate; up] slice "
        "from the slice's start: the up rows' Adam moments are the gate rows' (etp > 1)",
        (
            (
                "lightning_sp/checkpoint/shards.py",
                "    within = shard.within or (0,) * local.dim()\n",
                "    within = (0,) * local.dim()\n",
            ),
        ),
        ("tests/test_moe_parallel.py", "-k", "checkpoint"),
        r"gate_up \(replicated optimizer\): a weight or Adam moment saved at etp = 2 loads into "
        r"other rows",
    ),
    Mutation(
        "scatter_rows_rank0_count",
        "expert TP: scatter_rows keeps TP rank 0's row count on every rank (a rank holding more "
        "rows loses some; the quick tier's layouts hold equal counts)",
        (
            (
                "lightning_sp/parallel/expert_rows.py",
                "    return out[: sum(plan.per_rank[group_rank(plan.group)])]",
                "    return out[: sum(plan.per_rank[0])]",
            ),
        ),
        ("tests/test_two_ranks_quick.py",),
        r"scatter_rows gave \[[^]]*\]; this rank's own 5 rows summed over the TP group",
    ),
    Mutation(
        "shared_width_unchecked",
        "the shared experts' width is not checked against tensor_parallel_size",
        (
            (
                "lightning_sp/model/moe/config.py",
                "        if self.shared_ffn_size % t:\n",
                "        if False:\n",
            ),
        ),
        ("tests/test_moe.py", "-k", "shared_experts_width"),
        r"shared experts of width 6 at tensor_parallel_size=4 were accepted",
    ),
    Mutation(
        "hf_family_eps_default",
        "Hugging Face import: a config.json without rms_norm_eps is read with Llama's 1e-6 in "
        "every family (OLMo 2, OLMoE and Mixtral take 1e-5 in transformers)",
        (
            (
                "lightning_sp/interop/hf_llama.py",
                'ConfigField("layernorm_eps", "rms_norm_eps", default=rms_norm_eps),',
                'ConfigField("layernorm_eps", "rms_norm_eps", default=1e-6),',
            ),
        ),
        ("tests/test_hf_families.py", "-k", "absent_keys"),
        r"a config\.json without the key of layernorm_eps is read as layernorm_eps=1e-06; "
        r"transformers reads 1e-05",
    ),
    Mutation(
        "hf_family_theta_default",
        "Hugging Face import: a config.json without rope_theta is read with base 10000 in every "
        "family (Mixtral's is 1e6 in transformers)",
        (
            (
                "lightning_sp/interop/hf_llama.py",
                'rope["rope_theta"] = hf.get("rope_theta", theta)',
                'rope["rope_theta"] = hf.get("rope_theta", 10000.0)',
            ),
        ),
        ("tests/test_hf_families.py", "-k", "absent_keys"),
        r"mixtral: a config\.json without the key of rope_theta is read as rope_theta=10000\.0",
    ),
    Mutation(
        "hf_tie_default_true",
        "Hugging Face import: a Llama-style config.json without tie_word_embeddings is read as "
        "tied (transformers unties these families by default)",
        (
            (
                "lightning_sp/interop/hf_llama.py",
                'ConfigField("tie_embeddings", "tie_word_embeddings", default=False),',
                'ConfigField("tie_embeddings", "tie_word_embeddings", default=True),',
            ),
        ),
        ("tests/test_hf_families.py", "-k", "absent_keys"),
        r"without the key of tie_embeddings is read as tie_embeddings=True; transformers reads "
        r"False",
    ),
    Mutation(
        "export_bos_token_id_none",
        "export: config.json's bos_token_id is null, not the end-of-document id that also "
        "begins documents (transformers' generate then has no token to start from)",
        (
            (
                "lightning_sp/interop/hf_tables.py",
                '"bos_token_id": eos_token_id,',
                '"bos_token_id": None,',
            ),
        ),
        ("tests/test_hf_export.py", "-k", "token_ids"),
        r"config\.json bos_token_id=None, not <\|endoftext\|>'s id 3",
    ),
    Mutation(
        "export_eos_byte_id",
        "export of a run with a tokenizer.json: eos_token_id is the byte-level 256, not the "
        "tokenizer's end-of-document id",
        (
            (
                "lightning_sp/cli/export.py",
                "return str(path), eos, eos_id if eos_id is not None else BYTE_EOS_ID",
                "return str(path), eos, BYTE_EOS_ID",
            ),
        ),
        ("tests/test_hf_export.py", "-k", "token_ids"),
        r"config\.json eos_token_id=256, not <\|endoftext\|>'s id 3",
    ),
    Mutation(
        "export_tokenizer_bos_none",
        "export: tokenizer_config.json names no bos_token (the model's config.json does)",
        (("lightning_sp/interop/hf_export.py", '"bos_token": eos_token,', '"bos_token": None,'),),
        ("tests/test_hf_export.py", "-k", "token_ids"),
        r"tokenizer_config\.json bos_token=None",
    ),
    Mutation(
        "export_dtype_float32",
        "export: config.json says dtype float32 whatever the tensors' dtype (a bf16 export loads "
        "as fp32)",
        (
            (
                "lightning_sp/interop/hf_export.py",
                'hf["dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 '
                'else "float32"',
                'hf["dtype"] = "float32"',
            ),
        ),
        ("tests/test_hf_export.py", "-k", "token_ids"),
        r"config\.json dtype='float32' of bf16 tensors",
    ),
    Mutation(
        "export_drops_linear_rope",
        "export: linear RoPE scaling is written as none (a Llama with linear scaling cannot be "
        "exported)",
        (
            (
                "lightning_sp/interop/hf_llama.py",
                'return {"rope_type": "linear", "factor": scaling.factor}',
                "return None",
            ),
        ),
        ("tests/test_hf_export.py", "-k", "round_trip_gives_back_every_tensor"),
        r"rope_scaling=RopeScaling\(.*rope_type='linear'\) does not match rope_scaling=None",
    ),
    Mutation(
        "hf_gpt2_prefix_required",
        "Hugging Face import: a GPT-2 file without the transformer. prefix (OpenAI's upload) is "
        "refused",
        (
            (
                "lightning_sp/interop/hf.py",
                "short = name.removeprefix(prefix) if prefix else name",
                "short = name",
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "without_the_transformer_prefix"),
        r"a GPT-2 file without the 'transformer\.' prefix \(OpenAI's\) is not read",
    ),
    Mutation(
        "hf_moe_normalize_default_true",
        "Hugging Face import: a Qwen3-MoE / OLMoE config.json without norm_topk_prob is read as "
        "renormalising the top-k weights (transformers: not)",
        (
            (
                "lightning_sp/interop/hf_moe.py",
                "normalize_top_k=self.normalize is None or bool(hf.get(self.normalize)),",
                "normalize_top_k=self.normalize is None or bool(hf.get(self.normalize, True)),",
            ),
        ),
        ("tests/test_hf_families.py", "-k", "absent_keys"),
        r"without the key of moe\.normalize_top_k is read as moe\.normalize_top_k=True; "
        r"transformers reads False",
    ),
    Mutation(
        "hf_rotary_table_refused",
        "Hugging Face import: an older Llama file's rotary table rotary_emb.inv_freq is refused "
        "as a tensor with no place (transformers drops it without a word)",
        (
            (
                "lightning_sp/interop/hf.py",
                'IGNORED = re.compile(r"(^|\\.)h\\.\\d+\\.attn\\.bias$|rotary_emb\\.inv_freq$")',
                'IGNORED = re.compile(r"(^|\\.)h\\.\\d+\\.attn\\.bias$")',
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "without_a_word"),
        r"rotary_emb\.inv_freq: transformers loads the file without a word; we refuse it",
    ),
    Mutation(
        "hf_tied_lm_head_refused",
        "Hugging Face import: a tied model's file holding lm_head.weight is refused (transformers "
        "loads it without a word)",
        (
            (
                "lightning_sp/interop/hf.py",
                'if config.tie_embeddings and key.removeprefix("model.") == "lm_head.weight":',
                "if False:",
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "without_a_word"),
        r"lm_head\.weight: transformers loads the file without a word; we refuse it",
    ),
    Mutation(
        "hf_index_first_file_only",
        "Hugging Face import: of a sharded directory only the first file its "
        "model.safetensors.index.json names is read",
        (
            (
                "lightning_sp/interop/hf.py",
                'files = sorted(set(index["weight_map"].values()))',
                'files = sorted(set(index["weight_map"].values()))[:1]',
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "every_file_of_its_index"),
        r"a directory sharded in \d+ files is not read whole",
    ),
    Mutation(
        "export_tokenizer_unchecked",
        "export: --tokenizer of another vocabulary than the run's is taken (its ids name other "
        "tokens than the model was trained on)",
        (
            (
                "lightning_sp/cli/export.py",
                'if recorded not in (None, f"tokenizers:{digest[:16]}"):',
                "if False:",
            ),
        ),
        ("tests/test_hf_export.py", "-k", "another_tokenizer"),
        r"export took another tokenizer\.json than the run's",
    ),
    Mutation(
        "hf_legacy_rope_type_ignored",
        "Hugging Face import: transformers 4's rope_scaling {type: linear} is read as no scaling "
        "(only rope_type is looked at)",
        (
            (
                "lightning_sp/interop/hf_llama.py",
                'kind = rope.get("rope_type", rope.get("type", "default"))',
                'kind = rope.get("rope_type", "default")',
            ),
        ),
        ("tests/test_hf_families.py", "-k", "legacy_rope"),
        r"rope_scaling \{'type': 'linear', 'factor': 2\.0\} read as rope_scaling=None; "
        r"transformers applies linear scaling",
    ),
    Mutation(
        "lr_warmup_off_by_one",
        "the warm-up trains step k at k/warmup·lr: step 0 at lr 0, the peak one step late",
        (
            (
                "lightning_sp/optim/adamw.py",
                "        return (step + 1) / warmup\n",
                "        return step / warmup\n",
            ),
        ),
        ("tests/test_optim.py", "-k", "lr_schedule"),
        r"step 0: lr 0, expected 0\.00025 \(linear warm-up",
    ),
    Mutation(
        "lr_cosine_to_zero",
        "the cosine decays from lr to 0, not to min_lr",
        (
            (
                "lightning_sp/optim/adamw.py",
                "    return (floor + 0.5 * (peak - floor) * (1.0 + math.cos(",
                "    return (0.5 * (peak - floor) * (1.0 + math.cos(",
            ),
        ),
        ("tests/test_optim.py", "-k", "lr_schedule"),
        r"step 4: lr 0\.0009, expected 0\.001 \(linear warm-up",
    ),
    Mutation(
        "sample_temperature_zero_not_greedy",
        "temperature 0 samples from the softmax instead of taking the argmax",
        (
            (
                "lightning_sp/model/generate.py",
                "        return int(logits.argmax())\n",
                "        return int(torch.multinomial(torch.softmax(logits, -1), 1, "
                "generator=generator))\n",
            ),
        ),
        ("tests/test_generate.py", "-k", "temperature_zero"),
        r"temperature 0 drew tokens \[.*\], not only the argmax 1",
    ),
    Mutation(
        "sample_temperature_multiplies",
        "the logits are multiplied by the temperature instead of divided",
        (
            (
                "lightning_sp/model/generate.py",
                "    logits = logits / config.temperature\n",
                "    logits = logits * config.temperature\n",
            ),
        ),
        ("tests/test_generate.py", "-k", "sampling"),
        r"temperature 2: token frequencies \[.*\], expected softmax\(logits / 2\)",
    ),
    Mutation(
        "sample_top_k_masks_to_zero",
        "top_k sets the cut tokens' logits to 0 instead of -inf: they are still drawn",
        (
            (
                "lightning_sp/model/generate.py",
                'logits.masked_fill(logits < cutoff, float("-inf"))',
                "logits.masked_fill(logits < cutoff, 0.0)",
            ),
        ),
        ("tests/test_generate.py", "-k", "sampling"),
        r"top_k=2: token frequencies \[.*\], expected \[.*\] \(only the 2 most likely",
    ),
    Mutation(
        "generate_temperature_nan_accepted",
        "generate's temperature checked >= 0 only: nan and inf pass the check and fail (or "
        "sample uniformly) after the checkpoint is loaded",
        (
            (
                "lightning_sp/model/generate.py",
                '        finite_number("temperature", self.temperature, "a finite number >= 0 '
                '(0 is greedy)",\n                      lambda v: v >= 0)  # fmt: skip\n',
                '        if self.temperature < 0:\n            raise ConfigError(f"temperature='
                '{self.temperature!r} must be a finite number >= 0 (0 is greedy)")\n',
            ),
        ),
        ("tests/test_generate.py", "-k", "temperature_must"),
        r"temperature=(nan|inf) accepted: the check must refuse it before the checkpoint",
    ),
    Mutation(
        "mfu_peak_inf_accepted",
        "MFUMonitor's peak_flops_per_device checked > 0 only: inf passes and MFU logs 0",
        (
            (
                "lightning_sp/callbacks/throughput.py",
                "        if peak_flops_per_device is not None:\n",
                "        if peak_flops_per_device is not None and not peak_flops_per_device > 0:\n",
            ),
        ),
        ("tests/test_callbacks.py", "-k", "peak_must"),
        r"peak_flops_per_device=inf accepted: MFU would be logged as 0",
    ),
    Mutation(
        "guard_skips_never_reset",
        "nonfinite='skip' never resets its count after a finite step: non-consecutive skips add up "
        "to max_skipped_steps and stop the run",
        (
            (
                "lightning_sp/runtime/guard.py",
                "            self.skipped = 0\n            return True\n",
                "            return True\n",
            ),
        ),
        ("tests/test_guard.py", "-k", "skip_counts"),
        r"skip policy with max_skipped_steps=2 over NaN, NaN, 1, NaN, NaN, NaN: .*'stopped: "
        r"non-finite loss \(rank 0\) at step 3",
    ),
    Mutation(
        "guard_skips_one_too_many",
        "nonfinite='skip' allows max_skipped_steps + 1 skips in a row before it stops",
        (
            (
                "lightning_sp/runtime/guard.py",
                "self.skipped < self.max_skipped_steps",
                "self.skipped <= self.max_skipped_steps",
            ),
        ),
        ("tests/test_guard.py", "-k", "skip_counts"),
        r"skip policy with max_skipped_steps=2 over NaN, NaN, 1, NaN, NaN, NaN: \[('\w+', ){5}"
        r"'skipped'\]",
    ),
    Mutation(
        "guard_skip_keeps_gradients",
        "a skipped step keeps its non-finite gradients (not zeroed)",
        (
            (
                "lightning_sp/runtime/guard.py",
                "            optimizer.zero_grad()\n            return False\n",
                "            return False\n",
            ),
        ),
        ("tests/test_guard.py", "-k", "skip_counts"),
        r"step 0 skipped without zeroing the gradients",
    ),
    Mutation(
        "bar_mfu_not_percent",
        "the progress bar shows MFU's fraction with a % sign (0.38 as 0%), not the percentage",
        (
            (
                "lightning_sp/callbacks/throughput.py",
                "{100 * last['mfu']:.0f}%",
                "{last['mfu']:.0f}%",
            ),
        ),
        ("tests/test_callbacks.py", "-k", "bar_items"),
        r"bar items \{'MFU': '0%', 'tok/s': '12\.3k'\}, expected MFU 38%",
    ),
    Mutation(
        "decay_steps_within_warmup_accepted",
        "decay_steps <= warmup_steps accepted: the cosine never runs, the rate drops from lr to "
        "min_lr in one step",
        (
            (
                "lightning_sp/training/checks.py",
                "    if decay is not None and decay <= optimizer.warmup_steps:",
                "    if decay is not None and decay < optimizer.warmup_steps:",
            ),
        ),
        ("tests/test_config_errors.py", "-k", "optimizer_values"),
        r"check_optimizer accepted the value: no ConfigError .*decay_steps=10",
    ),
    Mutation(
        "val_loss_mean_of_batch_means",
        "with loss masks, val/loss averages the batches' token means unweighted instead of the "
        "split's token mean",
        (
            (
                "lightning_sp/training/gpt_module.py",
                "            self.val_loss.update(loss / tokens, weight=tokens)\n",
                "            self.val_loss.update(loss / tokens)\n",
            ),
        ),
        ("tests/test_token_mean.py", "-k", "validation_with"),
        r"val/loss \d+\.\d+, the token mean over the split's 4 rows is \d+\.\d+ \(the mean of "
        r"the batches' means",
    ),
    Mutation(
        "clip_val_negative_accepted",
        "a negative gradient_clip_val accepted (as Lightning does): the clip coefficient "
        "max_norm / norm < 0 flips the gradients' sign",
        (
            (
                "lightning_sp/training/checks.py",
                'finite_number("trainer.gradient_clip_val", value, valid, lambda v: v >= 0)',
                'finite_number("trainer.gradient_clip_val", value, valid, lambda v: True)',
            ),
        ),
        ("tests/test_config_errors.py", "-k", "clipping"),
        r"check_gradient_clipping accepted the value: no ConfigError .*gradient_clip_val=",
    ),
    Mutation(
        "clip_hook_unchecked",
        "GPTModule's clipping hook (the Python API, no cli.py check before it) clips by a "
        "negative, nan or inf gradient_clip_val",
        (
            (
                "lightning_sp/training/optimizer_hooks.py",
                "        check_gradient_clipping(gradient_clip_val, gradient_clip_algorithm)\n",
                "",
            ),
        ),
        ("tests/test_config_errors.py", "-k", "clipping"),
        r"configure_gradient_clipping accepted the value: no ConfigError",
    ),
    Mutation(
        "pipeline_overlap_one_layer",
        "step-time model: an interleaved pipeline's transfer hides behind one layer's forward, "
        "not the next chunk's L/(p·m) layers",
        (
            (
                "lightning_sp/planner/steptime.py",
                "            one = max(0.0, one - chunk * sum(layer.forward.values()))",
                "            one = max(0.0, one - sum(layer.forward.values()))",
            ),
        ),
        ("tests/test_steptime_overlap.py", "-k", "whole_chunk"),
        r"interleaved pipeline_overlap: exposed p2p .* not one layer's",
    ),
    Mutation(
        "lora_saving_skips_bubble",
        "LoRA step time: the frozen base's shorter backward is taken off the n micro-batches "
        "only, not the pipeline bubble's (p-1)/m passes",
        (
            (
                "lightning_sp/planner/lora.py",
                '    seconds = parts["pipeline"] - (n + (p - 1) / m) * config.num_layers / p '
                "* layer",
                '    seconds = parts["pipeline"] - n * config.num_layers / p * layer',
            ),
        ),
        ("tests/test_planner_lora.py", "-k", "bubble"),
        r"LoRA at p = 2: the bubble's layers save",
    ),
    Mutation(
        "lora_optimizer_unsharded",
        "LoRA step time: Adam's step over every adapter parameter on each rank, not this "
        "rank's distributed-optimizer shard",
        (
            (
                "lightning_sp/planner/lora.py",
                "    shard = adapters / shards if zero else adapters",
                "    shard = adapters",
            ),
        ),
        ("tests/test_planner_lora.py", "-k", "sharded"),
        r"LoRA with the distributed optimizer over d = 4: the step is",
    ),
    Mutation(
        "lora_full_experts_over_dp",
        "LoRA estimate: the full fine-tune's routed experts' optimizer state sharded over the "
        "d·c ranks, not the d·c/e holding the same experts",
        (
            (
                "lightning_sp/planner/lora.py",
                "    full_state += model_state_bytes(experts, precision, shards // e, zero)",
                "    full_state += model_state_bytes(experts, precision, shards, zero)",
            ),
        ),
        ("tests/test_planner_lora.py", "-k", "expert_data_ranks"),
        r"full fine-tune at e = 2, d = 4, distributed optimizer: model state",
    ),
    Mutation(
        "search_sp_at_t1",
        "estimate --search ranks sequence parallelism at t = 1 (the SP-off row again, each such "
        "layout twice)",
        (
            (
                "lightning_sp/planner/search.py",
                "            if row.sequence_parallel and layout.tensor_parallel_size == 1:\n"
                "                continue\n",
                "",
            ),
        ),
        ("tests/test_estimate_inputs.py", "-k", "each_layout_once"),
        r"search ranks sequence parallelism at t = 1",
    ),
    Mutation(
        "dpo_reference_no_bubble",
        "DPO reference forward priced for the n micro-batches only, not the forward "
        "schedule's (p-1)/m bubble",
        (
            (
                "lightning_sp/planner/dpo.py",
                "    seconds = (n + (p - 1) / m) * config.num_layers / p * layer + n * ends",
                "    seconds = n * config.num_layers / p * layer + n * ends",
            ),
        ),
        ("tests/test_planner_dpo.py", "-k", "through_a_pipeline"),
        r"DPO reference forward at p = 2, m = \d, SP off: .* by hand",
    ),
    Mutation(
        "dpo_reference_ends_summed",
        "DPO reference forward: under a pipeline the embedding (first stage) and the head "
        "(last stage) both priced on the path, not the slower of the two",
        (
            (
                "lightning_sp/planner/dpo.py",
                "    ends = head + embedding if p == 1 else max(head, embedding)",
                "    ends = head + embedding",
            ),
        ),
        ("tests/test_planner_dpo.py", "-k", "through_a_pipeline"),
        r"DPO reference forward at p = 2, m = \d, SP off: .* by hand",
    ),
    Mutation(
        "packed_ids_in_flight",
        "first-stage bytes: packed documents' ids and positions counted for the micro-batches "
        "in flight, not all n of the step",
        (
            (
                "lightning_sp/planner/rows.py",
                "    total += acts.ids * n + acts.tables * in_flight",
                "    total += acts.ids * in_flight + acts.tables * in_flight",
            ),
        ),
        ("tests/test_document_bytes.py", "-k", "every_micro_batchs_ids"),
        r"first stage at p = 2, n = 4 with packed documents: \d+ B more",
    ),
    Mutation(
        "interleaved_in_flight_uncapped",
        "interleaved first stage: the warm-up's p·m + p - 1 chunk forwards counted even when "
        "the step has fewer (n·m)",
        (
            (
                "lightning_sp/memory/formulas.py",
                "    return min(p * m + p - 1, n * m)",
                "    return p * m + p - 1",
            ),
        ),
        ("tests/test_memory.py", "-k", "capped"),
        r"interleaved p = 2, m = 2, n = 2: 5 chunk forwards in flight",
    ),
    Mutation(
        "dpo_reference_embedding_half_all_reduce",
        "DPO reference forward without SP: the embedding's TP all-reduce priced as one ring "
        "pass (a reduce-scatter's), not two",
        (
            (
                "lightning_sp/planner/dpo.py",
                "embedding + (unit if sp else 2 * unit)",
                "embedding + unit",
            ),
        ),
        ("tests/test_planner_dpo.py", "-k", "through_a_pipeline"),
        r"DPO reference forward at p = 1, m = 1, SP off: .* by hand",
    ),
    Mutation(
        "search_json_drops_expert_sizes",
        "estimate --search --format json rows leave out expert_parallel_size and "
        "expert_tensor_parallel_size (rows differing only in the expert layout read alike)",
        (
            (
                "lightning_sp/planner/report.py",
                '        "expert_parallel_size": lay.expert_parallel_size,\n'
                '        "expert_tensor_parallel_size": lay.expert_tensor_parallel_size,\n',
                "",
            ),
        ),
        ("tests/test_moe_memory.py", "-k", "names_each"),
        r"search JSON row: \(e, etp\) = \(None, None\)",
    ),
    Mutation(
        "fp8_gemm_output_one_byte",
        "FP8 pricing: a float8 GEMM's output counted at 1 byte an element (it is bf16, 2)",
        (
            (
                "lightning_sp/planner/fp8.py",
                "    moved = operands + 2.0 * batch * m * n",
                "    moved = operands + 1.0 * batch * m * n",
            ),
        ),
        ("tests/test_planner_fp8.py", "-k", "two_byte"),
        r"memory-bound float8 GEMM: .* expected .*a 2-byte output",
    ),
    Mutation(
        "fp8_weight_gradient_bf16",
        "FP8 pricing: the linears' weight-gradient GEMMs priced in bf16, not float8",
        (
            (
                "lightning_sp/planner/layertime.py",
                "            dgrad[name], wgrad[name] = price(cluster, dg), price(cluster, wg)",
                "            dgrad[name] = price(cluster, dg)",
            ),
        ),
        ("tests/test_planner_fp8.py", "-k", "both_backward"),
        r"FP8 backward GEMMs: .* expected .*weight-gradient GEMMs of every linear in float8",
    ),
    Mutation(
        "fits_strict",
        "a row whose bytes fill the device exactly does not fit (< for <=)",
        (
            (
                "lightning_sp/planner/records.py",
                "        return self.total_bytes <= self.device_bytes\n\n"
                "    @property\n    def label",
                "        return self.total_bytes < self.device_bytes\n\n"
                "    @property\n    def label",
            ),
        ),
        ("tests/test_planner.py", "-k", "filling_the_device"),
        r"a row of \d+ B on a \d+ B device: no fit",
    ),
    Mutation(
        "experts_per_rank_all_stages",
        "expert_parameters_per_rank counts every layer's experts, not the L/p of one pipeline "
        "stage",
        (
            (
                "lightning_sp/memory/model_state.py",
                "        config.num_layers\n"
                "        // layout.pipeline_parallel_size\n"
                "        * (experts // layout.expert_parallel_size)",
                "        config.num_layers\n        * (experts // layout.expert_parallel_size)",
            ),
        ),
        ("tests/test_model_state.py", "-k", "expert_parameters_per_rank_by_hand"),
        r"routed experts per rank at p = 2, e = \d: \d+, by hand",
    ),
    Mutation(
        "p2p_part_per_micro_batch",
        "step-time parts: p2p reported for one micro-batch, not the iteration's n",
        (("lightning_sp/planner/steptime.py", '        "p2p": n * p2p,', '        "p2p": p2p,'),),
        ("tests/test_steptime_overlap.py", "-k", "transfers_per_iteration"),
        r"pipeline transfers per iteration: .* by hand n·2·send",
    ),
    Mutation(
        "hf_load_skips_check",
        "load_hf_weights reads without checking the files hold every tensor in shape (a tensor "
        "the files lack is a bare AssertionError mid-load)",
        (
            (
                "lightning_sp/interop/hf.py",
                "        weights.check()  # a tensor missing or of another shape: one line, "
                "before any read\n",
                "",
            ),
        ),
        ("tests/test_interop_hf.py", "-k", "lack_a_tensor"),
        r"files lacking \S+: AssertionError\(\S+\), not one ConfigError line",
    ),
)


class Stale(Exception):
    """A mutation's text is not in the code exactly once: the code moved, update the entry."""


TIMEOUT = 1800
"""Seconds one mutation's tests may run."""


def _apply(mutation: Mutation) -> dict[Path, str]:
    """Plant ``mutation``; the original texts of the files it changed. :class:`Stale` (with
    every file restored) when an edit's text is not there exactly once."""
    originals: dict[Path, str] = {}
    try:
        for path, old, new in mutation.edits:
            file = ROOT / path
            current = file.read_text() if file.exists() else ""
            originals.setdefault(file, current)
            if current.count(old) != 1:
                where = (
                    "is missing" if not file.exists() else f"holds it {current.count(old)} times"
                )
                raise Stale(f"{path} {where}: {old.strip()[:70]!r}")
            file.write_text(current.replace(old, new))
    except Stale:
        _restore(originals)
        raise
    return originals


def _restore(originals: dict[Path, str]) -> None:
    for file, text in originals.items():
        if file.exists():
            file.write_text(text)


def run(mutation: Mutation) -> tuple[str, list[str], str, float]:
    """Plant, test, restore: (``caught``, ``NOT CAUGHT``, ``STALE`` or ``TIMED OUT``, failed
    tests, the matching line or what went wrong, seconds)."""
    start = time.monotonic()
    try:
        originals = _apply(mutation)
    except Stale as stale:
        return "STALE", [], str(stale), 0.0
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return "TIMED OUT", [], f"after {TIMEOUT} s", time.monotonic() - start
    finally:
        _restore(originals)
    output = proc.stdout + proc.stderr
    failed = re.findall(r"^FAILED (\S+)", output, re.MULTILINE)
    lines = [
        line.strip() for line in output.splitlines() if re.search(mutation.expect, line)
    ]  # the assertion's own line ("E   ...") rather than its source in the traceback
    lines.sort(key=lambda line: not line.startswith("E "))
    line = re.sub(r"^E\s+", "", lines[0]) if lines else ""
    caught = proc.returncode != 0 and bool(lines)
    return "caught" if caught else "NOT CAUGHT", failed, line, time.monotonic() - start


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM (``timeout``) restores the files as Ctrl-C does


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    if argv == ["--list"]:
        for m in MUTATIONS:
            print(f"{m.name}: {m.bug}")
        return 0
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    unknown = set(argv) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    bad = []
    print("| mutation | command | failing tests | message |")
    print("| --- | --- | --- | --- |")
    for m in chosen:
        verdict, failed, line, seconds = run(m)
        command = "python -m pytest " + " ".join(f'"{a}"' if " " in a else a for a in m.tests)
        names = "<br>".join(f.split("::", 1)[-1] for f in failed) or "none"
        if verdict != "caught":
            line = f"**{verdict}** ({seconds:.0f} s){': ' + line if line else ''}"
        line = line.replace("|", "\\|")
        print(f"| `{m.name}`: {m.bug} | `{command}` | {names} | {line[:200]} |", flush=True)
        if verdict != "caught":
            bad.append(f"{m.name} ({verdict})")
    if bad:
        print(f"not caught: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
