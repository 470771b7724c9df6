"""Data pipeline figures: ``python -m benchmarks.data [--smoke] [--out DIR]``.

(1) Constant start-up: time to the first training step (end to end, and the data's own share:
the datamodule's setup plus building the loader and fetching the first batch, wall and CPU
seconds) and peak RSS per rank, fitting
``GPTModule`` under ``MegatronSPStrategy`` (2 data-parallel CPU ranks) from a prepared corpus
of ``--large-tokens`` (default 1e9, 2 GB of uint16) vs ``--small-tokens`` (default 1e6), as
ratios large / small. The corpora are written directly in the prepared format (random
byte-level tokens, metadata as ``prepare`` writes it): what is measured is ``fit`` reading a
prepared directory, not tokenization. Runs alternate small, large, large, small; medians.

(2) Prepare throughput: ``prepare`` of a seeded sample of the standard library's ``.py`` files
with a BPE ``tokenizer.json`` trained on them (vocabulary 8192), ``num_proc`` 1 vs 2, tokens/s
(documents are loaded once beforehand, so both time tokenizing and writing shards only).

Wall-clock figures on a shared machine are noisy; the ratios are the result. Results go to
``--out`` (``data.json`` and ``data.md``, one table) and stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback

from benchmarks._format import arguments, fixed, save, table
from lightning_sp import GPTConfig, GPTModule, MegatronSPStrategy, OptimizerConfig
from lightning_sp.data import (
    PrepareSettings,
    Source,
    TextDataModule,
    load_documents,
    prepare,
    tokenizer_info,
)
from lightning_sp.data.prepare import FORMAT, METADATA, SHARD_TOKENS
from lightning_sp.data.sources import stdlib_python_files
from lightning_sp.data.tokenizer import BYTES


def synthesize(directory: Path, tokens: int, seed: int = 0) -> None:
    """A prepared directory (byte-level tokenizer) of ``tokens`` random training tokens and a
    small validation split, written shard by shard (never whole in memory)."""
    rng = np.random.default_rng(seed)
    splits = {"train": tokens, "val": max(4096, tokens // 1000)}
    for split, count in splits.items():
        (directory / split).mkdir(parents=True)
        shards: list[dict[str, Any]] = []
        for first in range(0, count, SHARD_TOKENS):
            n = min(SHARD_TOKENS, count - first)
            name = f"{len(shards):05d}.bin"
            with open(directory / split / name, "wb") as f:
                for start in range(0, n, 1 << 24):
                    rng.integers(0, 256, min(1 << 24, n - start), dtype=np.uint16).tofile(f)
            shards.append({"file": name, "tokens": n})
        np.asarray([count], dtype=np.uint64).tofile(directory / split / "documents.idx")
        index = {"dtype": "uint16", "tokens": count, "documents": 1, "shards": shards}
        (directory / split / "index.json").write_text(json.dumps(index))
    meta = {
        "format": FORMAT,
        "tokenizer": {**dataclasses.asdict(BYTES), "id": BYTES.id},
        "dtype": "uint16",
        "source": {"identity": {"synthetic": tokens}, "description": "random bytes"},
        "splits": {s: {"tokens": c, "documents": 1} for s, c in splits.items()},
        "tokens": sum(splits.values()),
        "documents": 2,
    }
    (directory / METADATA).write_text(json.dumps(meta))


class TimedData(TextDataModule):
    """``TextDataModule`` that records the wall and CPU seconds of its ``setup``."""

    def setup(self, stage: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        super().setup(stage)
        self.setup_seconds = (time.perf_counter() - wall, time.process_time() - cpu)


class FirstStep(Callback):
    """Each rank writes to ``<folder>/rank<r>.json``: seconds from ``start`` (before
    ``Trainer(...)``) to its first training step; the data's own share of that, wall and CPU
    (the datamodule's ``setup``, plus ``on_fit_start`` -> first batch: building the train
    loader and fetching the first batch); and its peak RSS after the step."""

    def __init__(self, folder: str, start: float) -> None:
        self.folder, self.start = folder, start
        self.first: float | None = None
        self.fit_start = (0.0, 0.0)
        self.to_batch = (0.0, 0.0)

    def on_fit_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.fit_start = (time.perf_counter(), time.process_time())

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = time.time() - self.start
            wall, cpu = self.fit_start
            self.to_batch = (time.perf_counter() - wall, time.process_time() - cpu)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        setup = trainer.datamodule.setup_seconds  # type: ignore[attr-defined]
        record = {
            "first_step_s": self.first,
            "data_wall_s": setup[0] + self.to_batch[0],
            "data_cpu_s": setup[1] + self.to_batch[1],
            "peak_rss_bytes": rss,
        }
        Path(self.folder, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def fit_once(prepared: Path, folder: Path) -> list[dict[str, float]]:
    """One 1-step fit on 2 data-parallel ranks; the per-rank records."""
    folder.mkdir(parents=True)
    config = GPTConfig(vocab_size=257, seq_length=256, hidden_size=64, num_layers=2,
                       num_heads=4)  # fmt: skip
    start = time.time()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=MegatronSPStrategy(tensor_parallel_size=1, start_method="spawn"),
        callbacks=[FirstStep(str(folder), start)], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    data = TimedData(prepared_dir=str(prepared), seq_length=256, batch_size=8)
    trainer.fit(GPTModule(config, OptimizerConfig()), data)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def startup(work: Path, small: int, large: int) -> dict[str, Any]:
    """Median per-rank time to first step and peak RSS, large vs small corpus."""
    dirs = {"small": work / "small", "large": work / "large"}
    t = time.perf_counter()
    synthesize(dirs["small"], small)
    synthesize(dirs["large"], large, seed=1)
    print(f"wrote the prepared corpora in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    runs: dict[str, list[dict[str, float]]] = {"small": [], "large": []}
    for i, which in enumerate(("small", "large", "large", "small")):
        runs[which] += fit_once(dirs[which], work / f"run{i}-{which}")
    keys = ("first_step_s", "data_wall_s", "data_cpu_s", "peak_rss_bytes")
    med = {w: {k: statistics.median(r[k] for r in runs[w]) for k in keys} for w in runs}
    return {
        "tokens": {"small": small, "large": large},
        "bytes_on_disk": {"small": 2 * small, "large": 2 * large},
        "per_rank_records": runs,
        "median": med,
        **{f"ratio_{k}": med["large"][k] / med["small"][k] for k in keys},
    }


def prepare_throughput(work: Path, documents: int) -> dict[str, Any]:
    """tokens/s of ``prepare`` with ``num_proc`` 1 and 2 on the same documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    files = sorted(random.Random(0).sample(stdlib_python_files(), documents))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    special = ["[UNK]", "<|endoftext|>"]
    tok.train(files[:50], trainers.BpeTrainer(vocab_size=8192, special_tokens=special))
    tok.save(str(work / "tokenizer.json"))
    info = tokenizer_info(str(work / "tokenizer.json"))
    source = Source(tuple(files), None, "text", None, 0)
    load_documents(source, str(work / "cache"))  # load once: both runs time tokenizing only
    out: dict[str, Any] = {"documents": documents}
    for num_proc in (1, 2):
        meta = prepare(source, info, str(work / f"prep{num_proc}"),
                       PrepareSettings(0.01, 0, num_proc=num_proc), str(work / "cache"),
                       log=lambda _: None)  # fmt: skip
        out[f"num_proc_{num_proc}"] = {"tokens": meta["tokens"],
                                       "seconds": meta["prepare_seconds"],
                                       "tokens_per_second": meta["tokens_per_second"]}  # fmt: skip
    out["ratio_2_over_1"] = (
        out["num_proc_2"]["tokens_per_second"] / out["num_proc_1"]["tokens_per_second"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    documents = (300, 20, "prepare: stdlib files")
    args = arguments(__doc__, argv, "tiny sizes; numbers mean nothing", large_tokens=(1e9, 2e5),
                     small_tokens=(1e6, 1e5), documents=documents)  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        s = startup(Path(tmp) / "s", int(args.small_tokens), int(args.large_tokens))
        p = prepare_throughput(Path(tmp), args.documents)
    m = s["median"]
    rows = [
        [label, fixed(s[f"ratio_{key}"], 3), fixed(m["large"][key] / scale, 3),
         fixed(m["small"][key] / scale, 3)]
        for key, label, scale in (
            ("first_step_s", "time to first step s (spawn + imports + data)", 1),
            ("data_wall_s", "data share of it, wall s", 1),
            ("data_cpu_s", "data share of it, CPU s", 1),
            ("peak_rss_bytes", "peak RSS per rank MiB", 2**20),
        )
    ]  # fmt: skip
    rows.append([
        "prepare tokens/s", fixed(p["ratio_2_over_1"]),
        fixed(p["num_proc_2"]["tokens_per_second"], 0),
        fixed(p["num_proc_1"]["tokens_per_second"], 0),
    ])  # fmt: skip
    header = ["measure", "large / small (prepare: num_proc 2 / 1)", "large (2)", "small (1)"]
    save(args, argv, "data", {"startup": s, "prepare": p}, table(header, rows), smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
