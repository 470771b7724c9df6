"""Checkpoints (the lightning_sp.checkpoint package): resharding between layouts on 4
gloo ranks, crash safety under kill -9, the non-finite guard."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_sp import (
    GPT,
    GPTConfig,
    GPTModule,
    MegatronSPStrategy,
    OptimizerConfig,
    ParallelState,
    Pipeline,
)
from lightning_sp.checkpoint import Checkpointer, Meta, read_full, rng_key, verify
from lightning_sp.data import TextDataModule
from lightning_sp.optim.adamw import build_adamw
from lightning_sp.parallel.config import ParallelConfig
from lightning_sp.parallel.grads import finalize_grads
from lightning_sp.testing.spawn import run_distributed

from cli_runs import CLI, ROOT, SMALL, error_lines, gone, run
from models import batch, tiny_config

# (t, p, m, SP); d = 4 / (t * p)
LAYOUT_A = (2, 1, 1, True)
RESHARD_TO = [(1, 1, 1, False), (4, 1, 1, True), (1, 2, 2, False)]
LAYOUT_C = (2, 2, 2, True)
GLOBAL_BATCH, MICROBATCHES = 4, 2
LOSS_RTOL, WEIGHT_RTOL = 1e-10, 1e-8


class Run:
    """A GPT (or pipeline) shard in one layout, trained with AdamW on a fixed global batch."""

    def __init__(self, layout: tuple[int, int, int, bool], dtype: torch.dtype) -> None:
        t, p, m, sp = layout
        self.state = ParallelState.from_process_group(t, p)
        config = tiny_config(num_layers=4, sequence_parallel=sp)
        if p == 1:
            self.model: torch.nn.Module = GPT(config, self.state, dtype=dtype)
        else:
            self.model = Pipeline(config, self.state, num_microbatches=MICROBATCHES,
                                  virtual_pipeline_size=m, dtype=dtype)  # fmt: skip
        self.config, self.m, self.sp = config, m, sp
        self.optimizer = build_adamw(self.model, 1e-2, 0.1, (0.9, 0.95), 1e-8)

    @property
    def layout(self) -> ParallelConfig:
        s = self.state
        return ParallelConfig(
            tensor_parallel_size=s.tensor_parallel_size,
            pipeline_parallel_size=s.pipeline_parallel_size,
            virtual_pipeline_size=self.m,
            data_parallel_size=s.data_parallel_size,
        )

    def step(self, step: int) -> float:
        """One optimizer step on global batch ``step``; returns the global mean loss."""
        ids, labels = batch(self.config, GLOBAL_BATCH, seed=step)
        d, r = self.state.data_parallel_size, self.state.data_parallel_rank
        per = GLOBAL_BATCH // d
        ids, labels = ids[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        self.optimizer.zero_grad()
        if isinstance(self.model, Pipeline):
            loss = self.model.train_step(ids, labels)
            self.model.finalize_grads()
        else:
            loss = self.model(ids, labels)
            loss.backward()
            finalize_grads(self.model, self.state)
        self.optimizer.step()
        loss = loss.detach().clone()
        if self.state.dp_group is not None:
            dist.all_reduce(loss, group=self.state.dp_group)
            loss /= d
        return loss.item()

    def save(self, path: Path, step: int) -> None:
        s = self.state
        Checkpointer().save(
            path, self.model, [self.optimizer],
            meta=Meta(step, self.layout, dataclasses.asdict(self.config)),
            lightning_state={"global_step": step},
            rng=(rng_key(s.pipeline_parallel_rank, s.data_parallel_rank, s.tensor_parallel_rank),
                 None),
        )  # fmt: skip

    def load(self, path: Path) -> dict:
        return Checkpointer().load(
            path, self.model, [self.optimizer], layout=self.layout,
            model_config=dataclasses.asdict(self.config), rng_name="rng.none",
        )  # fmt: skip


def _compare(a: dict, b: dict, rtol: float, what: str) -> None:
    tensors = [
        k for k in a if k.startswith(("model.", "optim.")) and isinstance(a[k], torch.Tensor)
    ]
    assert tensors and set(tensors) <= set(b), f"{what}: keys differ"
    for key in tensors:
        x, y = a[key].double(), b[key].double()
        if rtol == 0:
            assert torch.equal(a[key], b[key]), f"{what}: {key} differs"
        else:
            err = (x - y).norm() / max(y.norm(), 1e-30)
            assert err <= rtol, f"{what}: {key} relative error {err:.2e}"


def _reshard_worker(rank: int, world_size: int, root: str) -> None:
    root_path = Path(root)

    def straight(layout: tuple, name: str) -> list[float]:
        run = Run(layout, torch.float64)
        for step in range(3):
            run.step(step)
        run.save(root_path / f"{name}3", 3)
        losses = [run.step(step) for step in (3, 4)]
        run.save(root_path / f"{name}5", 5)
        return losses

    def resumed(layout: tuple, source: str, name: str) -> list[float]:
        run = Run(layout, torch.float64)
        assert run.load(root_path / f"{source}3")["global_step"] == 3
        run.save(root_path / f"{name}3", 3)  # a re-save is the same checkpoint, bit for bit
        losses = [run.step(step) for step in (3, 4)]
        run.save(root_path / f"{name}5", 5)
        return losses

    def check(source: str, name: str, expected: list[float], losses: list[float]) -> None:
        if rank == 0:
            _compare(read_full(root_path / f"{name}3"), read_full(root_path / f"{source}3"), 0,
                     f"{name} re-save")  # fmt: skip
            _compare(read_full(root_path / f"{name}5"), read_full(root_path / f"{source}5"),
                     WEIGHT_RTOL, f"{name} after 2 steps")  # fmt: skip
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"{name}: loss {got} vs {want}"

    expected = straight(LAYOUT_A, "A")
    for i, layout in enumerate(RESHARD_TO):
        check("A", f"B{i}", expected, resumed(layout, "A", f"B{i}"))
    expected = straight(LAYOUT_C, "C")
    check("C", "D", expected, resumed((1, 1, 1, False), "C", "D"))

    # bf16 weights: MasterWeightAdamW's fp32 masters and Adam state reshard exactly, too
    run = Run(LAYOUT_A, torch.bfloat16)
    run.step(0)
    run.save(root_path / "bf16", 1)
    other = Run((1, 2, 2, False), torch.bfloat16)
    other.load(root_path / "bf16")
    other.save(root_path / "bf16-again", 1)
    if rank == 0:
        full = read_full(root_path / "bf16")
        assert any(k.endswith(".master") for k in full), "no master weights saved"
        _compare(read_full(root_path / "bf16-again"), full, 0, "bf16 re-save")


@pytest.mark.slow
def test_resharding_between_layouts() -> None:
    """Save at (t=2, SP), resume at t=1, t=4 and (p=2, m=2); save at (t=2, p=2, m=2), resume
    at t=1. Float64: a reload is bit-exact (re-saving gives the same bytes); the next two
    steps' losses agree within 1e-10 and weights + Adam state within 1e-8 relative, the
    difference being the summation order of the TP/DP/pipeline reductions (~1e-16 per
    operation), which Adam's division by sqrt(v) amplifies where v is small."""
    with tempfile.TemporaryDirectory() as root:
        run_distributed(_reshard_worker, 4, root)


# -- through cli.py: Lightning's launcher, 2 ranks, tiny.yaml at smoke size ---------------------

QUICK = ["--data.max_documents", "30", "--trainer.limit_val_batches", "0",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
         "--trainer.num_sanity_val_steps", "0"]  # fmt: skip


def _config(folder: Path) -> Path:
    """tiny.yaml, checkpointing every 2 steps into ``checkpoints`` and keeping them all."""
    text = (ROOT / "configs" / "tiny.yaml").read_text()
    text = text.replace(
        "every_n_train_steps: 100", "every_n_train_steps: 2\n        save_top_k: -1"
    )
    text = text.replace("dirpath: checkpoints/tiny", "dirpath: checkpoints")
    path = folder / "config.yaml"
    path.write_text(text)
    return path


def cli(
    folder: Path, *args: str, env: dict | None = None, timeout: float = 300, small: bool = True
):
    """``cli.py fit`` of :func:`_config` in ``folder``, without validation; ``small``: the
    model and batch of ``cli_runs.SMALL`` (which save a fault hits, what last.ckpt holds and
    how the ranks stop do not depend on the shapes; each step and save costs less)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [CLI, "fit", "--config", str(_config(folder)), *(SMALL if small else QUICK), *args]
    result = run(command, folder, timeout=timeout, env=env)
    result.ended = time.time()  # type: ignore[attr-defined]
    return result


def losses(folder: Path) -> dict[int, float]:
    rows = []
    for file in sorted((folder / "logs" / "csv").glob("version_*/metrics.csv")):
        with open(file) as fh:
            rows += [r for r in csv.DictReader(fh) if r.get("train/loss")]
    return {int(r["step"]): float(r["train/loss"]) for r in rows}


def digest(path: Path) -> str:
    """A hash of every file's bytes in a checkpoint (through its link)."""
    sha = hashlib.sha256()
    for file in sorted(path.resolve().iterdir()):
        sha.update(file.name.encode() + file.read_bytes())
    return sha.hexdigest()


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps straight, a checkpoint every 2 (step2, step4 and last), saved with
    ``async_save`` (the kill tests' blocking saves must equal these, bit for bit)."""
    folder = tmp_path_factory.mktemp("straight")
    result = cli(
        folder, "--trainer.max_steps", "4", "--trainer.strategy.init_args.async_save", "true"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def _tensors(path: Path) -> dict:
    full = read_full(path)
    return {k: v for k, v in full.items() if torch.is_tensor(v) and k.startswith("model.")}


FAULTS = {  # the 4th save is last.ckpt at step 4 (saves: step2, last, step4, last, ...)
    "shard-write": "shard:1:4",
    "between-ranks": "written:0:4",
    "before-rename": "rename:0:4",
}


# the first of these also pays for the module's straight run (a Trainer run of its own)
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", list(FAULTS))
def test_kill_during_save_leaves_last_at_the_previous_checkpoint(
    straight: Path, tmp_path: Path, point: str
) -> None:
    """kill -9 of one rank while last.ckpt is being rewritten at step 4: the job fails
    within 60 s, and last.ckpt is still the complete step-2 checkpoint (the same tensors as
    the straight run's step 2), never a mix; a resume from it equals the straight run."""
    result = cli(tmp_path, "--trainer.max_steps", "4",
                 env={"LIGHTNING_SP_CHECKPOINT_FAULT": FAULTS[point]})  # fmt: skip
    assert result.returncode != 0, result.stderr[-2000:]
    killed = re.search(r"fault injection: kill -9 of rank \d at \w+, time ([\d.]+)", result.stderr)
    assert killed, result.stderr[-2000:]
    assert result.ended - float(killed.group(1)) < 60, (  # every rank has exited by then
        f"the job ended {result.ended - float(killed.group(1)):.0f} s after the kill"
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    step = read_full(last)["lightning"]["global_step"]
    assert step == 2, f"last.ckpt holds step {step} after a kill during its rewrite, not step 2"
    want = _tensors(straight / "checkpoints" / "step2.ckpt")
    got = _tensors(last)
    assert want.keys() == got.keys(), f"last.ckpt's tensors differ: {want.keys() ^ got.keys()}"
    assert all(torch.equal(want[k], got[k]) for k in want), (
        "last.ckpt holds other tensors than the straight run's step 2: "
        f"{[k for k in want if not torch.equal(want[k], got[k])][:5]} (a mix of saves)"
    )
    names = {p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")}
    assert names <= {"step2.ckpt", "step4.ckpt", "last.ckpt"}, f"left behind: {sorted(names)}"
    if point == "before-rename":  # one resume is enough to show the rest follows
        resumed = cli(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", str(last))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        mine, theirs = losses(tmp_path), losses(straight)
        for step in (2, 3):
            assert mine[step] == pytest.approx(theirs[step], rel=1e-6), (
                f"step {step}: the resumed run's loss {mine[step]} is not the straight run's "
                f"{theirs[step]}: last.ckpt does not continue the run"
            )


@pytest.mark.parametrize(
    "case", ["disk full", "disk full after a SIGTERM in training", "KeyboardInterrupt", "SIGINT"]
)
def test_a_failed_save_is_one_line_and_an_interrupt_stays_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shutdown_handlers: None, case: str
) -> None:
    """In one process: a shard write that raises ``OSError`` is a ``CheckpointSaveError``
    of one line naming the checkpoint, the rank and the error, and the name still resolves to
    the previous save; so it is after a SIGTERM during training (which interrupts nothing: the
    save that ends the step runs on). A ``KeyboardInterrupt`` there (DCP wraps it like any
    failure) is not turned into a failed save: it reaches the shutdown path as DCP's
    exception; nor is a write that a SIGINT broke into another error (``SaveStopped``)."""
    import signal

    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_sp.checkpoint import CheckpointSaveError, commit
    from lightning_sp.checkpoint.checkpointer import SaveStopped
    from lightning_sp.checkpoint.dcp_planners import FaultyWriter
    from lightning_sp.runtime import shutdown

    config = tiny_config()
    model = GPT(config, ParallelState.single())
    optimizer = build_adamw(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)

    def save(step: int) -> None:
        Checkpointer().save(tmp_path / "last.ckpt", model, [optimizer],
                            meta=Meta(step, ParallelConfig(), dataclasses.asdict(config)),
                            lightning_state={"global_step": step},
                            rng=("rng.pp0.dp0.tp0", None))  # fmt: skip

    monkeypatch.setattr(commit, "_save_counts", {})  # this test's saves are 1 and 2
    save(1)

    def full(self: FaultyWriter, plan: object, planner: object) -> None:
        raise OSError("the disk is full")

    def interrupt(self: FaultyWriter, plan: object, planner: object) -> None:
        raise KeyboardInterrupt

    expected: type[BaseException] = CheckpointSaveError
    if case == "SIGINT":  # the fault point: SIGINT in the write, turned into a RuntimeError
        monkeypatch.setenv("LIGHTNING_SP_CHECKPOINT_FAULT", "interrupt:0:2")
        expected = SaveStopped
    elif case == "KeyboardInterrupt":
        monkeypatch.setattr(FaultyWriter, "write_data", interrupt)
        expected = CheckpointException
    else:
        if "SIGTERM" in case:
            shutdown.set_training(True)
            os.kill(os.getpid(), signal.SIGTERM)  # recorded; the step and its save run on
            assert shutdown.received() == signal.SIGTERM and not shutdown.interrupted()
        monkeypatch.setattr(FaultyWriter, "write_data", full)
    with pytest.raises(expected) as info:
        save(2)
    if expected is CheckpointSaveError:
        assert str(info.value) == (
            f"saving checkpoint {tmp_path / 'last.ckpt'} failed on rank 0: OSError: the disk "
            "is full; last.ckpt still holds the previous save"
        )
    assert read_full(tmp_path / "last.ckpt")["lightning"]["global_step"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_disk_full_on_one_rank_stops_every_rank_with_one_line(
    tmp_path: Path, async_save: bool
) -> None:
    """Rank 1's shard write of a save fails with ENOSPC: every rank stops with exit 4 and one
    line naming the checkpoint, rank 1 and the error, no traceback, no hang. Blocking saves:
    the 4th save (last.ckpt at step 4) fails and last.ckpt still holds step 2, complete (its
    checksums verify). With ``async_save`` (the failing save is the one being written when
    rank 1 counts its 2nd) the failure stops the run at the next save or at the end."""
    fault = "full:1:2" if async_save else "full:1:4"
    result = cli(tmp_path, "--trainer.max_steps", "6" if async_save else "4",
                 "--trainer.strategy.init_args.async_save", str(async_save).lower(),
                 env={"LIGHTNING_SP_CHECKPOINT_FAULT": fault})  # fmt: skip
    assert result.returncode == 4, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    name = r"(step\d|last)\.ckpt" if async_save else r"last\.ckpt"
    assert re.match(
        rf"error: saving checkpoint .*{name} failed on rank 1: OSError: \[Errno 28\] No space "
        r"left on device \(fault injection\); ",
        errors[0],
    ), errors[0]
    if not async_save:
        assert errors[0].endswith("; last.ckpt still holds the previous save"), errors[0]
        last = tmp_path / "checkpoints" / "last.ckpt"
        verify(last)
        assert read_full(last)["lightning"]["global_step"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_signal_that_breaks_a_save_is_a_stop_not_a_failed_save(tmp_path: Path) -> None:
    """Rank 1 receives SIGINT inside its shard write of the 4th save (last.ckpt at step 4),
    and the write turns the interrupt into a ``RuntimeError`` (as ``torch.save``'s zip writer
    did once in the full suite): the run ends as a Ctrl-C of rank 1 does (exit 130, one line
    naming rank 1's SIGINT, no traceback, rank 1 gone), not as a failed save (exit 4), and
    last.ckpt still holds step 2."""
    result = cli(tmp_path, "--trainer.max_steps", "6",
                 env={"LIGHTNING_SP_CHECKPOINT_FAULT": "interrupt:1:4"})  # fmt: skip
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    found = re.match(r"error: rank 1 \(pid (\d+)\) exited with code 130 \(SIGINT\)", errors[0])
    assert found, errors[0]
    assert gone(int(found.group(1))), "rank 1 lives on"
    last = tmp_path / "checkpoints" / "last.ckpt"
    verify(last)
    assert read_full(last)["lightning"]["global_step"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)  # a whole cli.py run; over 300 s seen on the shared 2-core machine
def test_nonfinite_loss_stops_with_one_line_and_keeps_last(straight: Path, tmp_path: Path) -> None:
    """lr 1e6 makes the loss NaN: exit 3, one line naming the step, and the checkpoint that
    was last before (copied from the straight run) is bit-for-bit intact."""
    import shutil

    (tmp_path / "checkpoints").mkdir()
    source = straight / "checkpoints" / "last.ckpt"
    shutil.copytree(source.resolve(), tmp_path / "checkpoints" / source.resolve().name)
    os.symlink(source.resolve().name, tmp_path / "checkpoints" / "last.ckpt")
    before = digest(tmp_path / "checkpoints" / "last.ckpt")
    # tiny.yaml's shapes: at lr 1e6 their loss is non-finite at step 1 (SMALL's stays finite)
    result = cli(tmp_path, "--trainer.max_steps", "4", "--model.optimizer.lr", "1e6", small=False)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = error_lines(result.stderr)
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(r"non-finite (loss|gradient norm) \(rank [\d, ]+\).* at step 1", errors[0])
    assert digest(tmp_path / "checkpoints" / "last.ckpt") == before
    assert not (tmp_path / "checkpoints" / "step2.ckpt").exists()


# -- the skip policy, under a real Trainer (2 spawned ranks) --------------------------------------


class PoisonedModule(GPTModule):
    """Rank 1's loss is NaN at steps 2 and 4."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step in (2, 4) and self.trainer.global_rank == 1:
            loss = loss * float("nan")
        return loss


@pytest.mark.slow
def test_skip_policy_drops_nonfinite_steps_and_continues(tmp_path: Path) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 60)
    config = GPTConfig(vocab_size=257, seq_length=32, hidden_size=32, num_layers=2, num_heads=4,
                       hidden_dropout=0.0, attention_dropout=0.0,
                       sequence_parallel=True)  # fmt: skip
    strategy = MegatronSPStrategy(tensor_parallel_size=2, start_method="spawn",
                                  nonfinite="skip", max_skipped_steps=1)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6,
                        logger=CSVLogger(tmp_path, name="run", version=0), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0)  # fmt: skip
    data = TextDataModule(paths=str(corpus), seq_length=32, batch_size=2, val_fraction=0.1)
    trainer.fit(PoisonedModule(config, OptimizerConfig(lr=1e-3, warmup_steps=1)), data)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    skipped = {int(r["step"]): float(r["train/skipped_steps"]) for r in rows
               if r.get("train/skipped_steps")}  # fmt: skip
    # counted (Lightning repeats the last value on the steps after), two non-consecutive pass
    assert min(skipped) == 2 and skipped[2] == 1.0 and skipped[4] == 2.0, skipped
    train = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert max(train) == 5 and all(math.isfinite(train[s]) for s in (3, 5)), train


def test_loader_with_a_stateful_sampler_is_resumable_for_lightning() -> None:
    from lightning.fabric.utilities.types import _Stateful
    from torch.utils.data import DataLoader

    from lightning_sp.checkpoint.checkpointer import resumable_loader

    class Sampler(list):
        position = 0

        def state_dict(self) -> dict:
            return {"position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.position = state["position"]

    stateful = DataLoader(list(range(8)), sampler=Sampler(range(8)))
    plain = DataLoader(list(range(8)))
    assert isinstance(resumable_loader(stateful), _Stateful)
    stateful.load_state_dict({"position": 5})
    assert stateful.sampler.position == 5 and stateful.state_dict() == {"position": 5}
    assert not isinstance(resumable_loader(plain), _Stateful)


def test_rng_streams_come_back_only_under_the_same_sequence_parallelism(tmp_path: Path) -> None:
    """Sequence parallelism is the model config's (``model.config.sequence_parallel``), not
    the layout's, so ``Checkpointer.load`` compares it itself: a checkpoint saved with SP on
    restores its dropout streams (an SP rank draws its s/t tokens' dropout from the sharded
    stream) into SP on, and resumed with SP off on the same layout it loads the weights but
    not the streams. So it is for a ``meta.json`` written while the layout also recorded
    ``sequence_parallel`` (the key is skipped)."""
    import json

    from lightning_sp.checkpoint.format import META_FILE

    saved = tiny_config(sequence_parallel=True)
    model = GPT(saved, ParallelState.single())
    model.rng.sharded.manual_seed(1234)  # a stream unlike a fresh model's
    path, key = tmp_path / "last.ckpt", "rng.pp0.dp0.tp0"
    streams = {"streams": model.rng.state_dict(), "torch": torch.get_rng_state()}
    Checkpointer().save(path, model, [], meta=Meta(1, ParallelConfig(), saved.values()),
                        lightning_state={"global_step": 1}, rng=(key, streams))  # fmt: skip
    meta_file = path.resolve() / META_FILE
    for written in ("now", "with the layout's sequence_parallel"):
        if written != "now":
            data = json.loads(meta_file.read_text())
            data["layout"]["sequence_parallel"] = True  # as files of the former format hold
            meta_file.write_text(json.dumps(data))
        for sp in (True, False):
            config = tiny_config(sequence_parallel=sp)
            resumed = GPT(config, ParallelState.single())
            back = Checkpointer().load(path, resumed, [], layout=ParallelConfig(),
                                       model_config=config.values(), rng_name=key)  # fmt: skip
            for (name, mine), theirs in zip(
                resumed.named_parameters(), model.parameters(), strict=True
            ):
                assert torch.equal(mine, theirs), f"{written}, SP={sp}: {name} did not load"
            if sp:
                restored = back["rng_streams"]["streams"]["sharded"]
                assert torch.equal(restored, streams["streams"]["sharded"]), (
                    f"{written}: saved and resumed with SP on, the sharded stream is not the "
                    "saved one"
                )
            else:
                assert back["rng_streams"] is None, (
                    f"{written}: saved with SP on, resumed with SP off: the SP-sharded dropout "
                    "streams were restored"
                )
