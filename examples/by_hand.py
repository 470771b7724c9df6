"""A tensor + sequence parallel GPT by hand, without Lightning.

    torchrun --standalone --nproc-per-node 2 examples/by_hand.py

Each rank builds only its shard, runs forward and backward, finishes the gradients the way the
strategy does, and reports the activation bytes its first layer saved for backward.
"""

import torch
import torch.distributed as dist

from lightning_sp import GPT, GPTConfig, ParallelState, SavedTensorTracker
from lightning_sp.model.recompute import RecomputePolicy
from lightning_sp.parallel.grads import finalize_grads

dist.init_process_group("gloo")  # "nccl" on GPUs
state = ParallelState.from_process_group(tensor_parallel_size=2)
config = GPTConfig(vocab_size=512, seq_length=256, hidden_size=256, num_layers=2, num_heads=8,
                   sequence_parallel=True,
                   recompute=RecomputePolicy.parse("selective"))  # fmt: skip
model = GPT(config, state, dtype=torch.bfloat16)  # this rank's shard only
tokens = torch.randint(0, 512, (2, 257), generator=torch.Generator().manual_seed(0))
with SavedTensorTracker.for_model(model) as tracker:
    loss = model(tokens[:, :-1], tokens[:, 1:])
loss.backward()
finalize_grads(model, state)  # sum sequence-parallel grads over TP, average over DP

sbh = 256 * 2 * 256
saved = tracker.report.bytes_of("layers.0") / sbh
print(
    f"rank {dist.get_rank()}: loss {loss.item():.4f}, layer 0 saved {saved:.4f} sbh (34/t = 17)",
    flush=True,
)
dist.destroy_process_group()
