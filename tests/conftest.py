import os

# Two cores: keep every process (and every spawned rank) to one intra-op thread so four ranks
# do not oversubscribe the machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
