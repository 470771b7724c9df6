"""Parallel state: the sizes, coordinates and process groups of one rank.

Ranks are laid out on a 4-D ``DeviceMesh`` with dimensions ``("pp", "dp", "cp", "tp")``. The
tensor parallel dimension varies fastest, so the ``t`` ranks of one tensor-parallel group are
adjacent (on one node, where NVLink is); the context-parallel dimension comes next, so a
context-parallel group joins the same TP rank of ``c`` neighbouring TP groups (the K/V exchange
of :mod:`lightning_sp.parallel.context_attention` runs between them). World ``= t·c·p·d``.

Expert parallelism (``e`` ranks, each holding ``E/e`` of a mixture-of-experts layer's experts)
folds into the ``d·c`` data x context ranks of equal (pp, tp), as Megatron-Core does (its order
tp-cp-ep-dp-pp): the ``d·c`` ranks, numbered ``dp_rank·c + cp_rank``, are cut into blocks of
``e`` consecutive ones, each block an expert-parallel (EP) group. Those ranks hold the same
attention and dense weights and see different tokens, so exchanging tokens among them costs no
weight replica, and no new rank is needed: EP multiplies no dimension of the world. A rank's
experts are replicated over the ``d·c/e`` ranks of equal EP rank (the *expert-data* group),
whose gradients are reduced over exactly that group. Folding EP into TP instead would split
the tensor-parallel group's bandwidth between two uses; into PP is impossible (different
layers).
A ``ParallelState`` is built once and passed explicitly to everything that communicates;
nothing in this package keeps process groups in globals.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_sp.errors import ConfigError
from lightning_sp.parallel.config import ParallelConfig

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def _group_options(backend: str, timeout: datetime.timedelta) -> tuple[str, Any] | None:
    """Backend options that carry ``timeout`` into the mesh's sub-groups."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in stubs
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return backend, options


@dataclass(frozen=True)
class ParallelState:
    """Where this rank sits in the tensor / pipeline / data / context parallel layout.

    Groups are ``None`` for a dimension of size one, and always ``None`` in :meth:`single`,
    so code that communicates is a no-op without a process group. The context-parallel fields
    come last with defaults (``c = 1``), so layouts without CP are built as before.
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    tensor_parallel_rank: int
    pipeline_parallel_rank: int
    data_parallel_rank: int
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    device: torch.device
    mesh: DeviceMesh | None = None
    context_parallel_size: int = 1
    """``c``: ranks each sample's sequence is split over (causal load balancing,
    :mod:`lightning_sp.parallel.context`)."""
    context_parallel_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    """The ``c`` ranks of equal (pp, dp, tp) coordinates; ``None`` for ``c = 1``."""
    data_context_group: dist.ProcessGroup | None = None
    """Under context parallelism, the ``d·c`` ranks of equal (pp, tp) coordinates (group rank
    ``dp_rank·c + cp_rank``); ``None`` for ``c = 1``. See :attr:`gradient_group`."""
    expert_parallel_size: int = 1
    """``e``: ranks of the data x context ranks that share out each MoE layer's experts."""
    expert_parallel_rank: int = 0
    """``(dp_rank·c + cp_rank) mod e``: which ``E/e`` experts this rank holds."""
    ep_group: dist.ProcessGroup | None = None
    """The ``e`` ranks that exchange tokens (``all_to_all``); ``None`` for ``e = 1``."""
    expert_data_group: dist.ProcessGroup | None = None
    """The ``d·c/e`` ranks of equal (pp, tp, EP rank): they hold the same experts (under expert
    tensor parallelism the same slice of them), and expert gradients are reduced over them;
    ``None`` when that is one rank."""
    expert_tensor_parallel_size: int = 1
    """``1``: experts whole on every TP rank; ``t``: each expert's inner dimension split over
    the TP group (the TP rank is the slice's rank)."""
    token_groups: dict[tuple[bool, bool], dist.ProcessGroup | None] = field(
        default_factory=dict, compare=False, repr=False
    )
    """The ranks holding shards of one micro-batch, keyed by (over TP, over CP); see
    :meth:`micro_batch_group`."""
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    """How long a collective of this rank's groups may wait; groups made later for this
    layout (the pipeline's embedding group) use it too."""
    _subgroups: dict[int, dist.ProcessGroup | None] = field(
        default_factory=dict, compare=False, repr=False
    )
    _layout: ParallelConfig | None = field(default=None, compare=False, repr=False)
    """The layout record this state was built from (:meth:`from_config`, :meth:`single`)."""

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelState:
        """The state of a lone process: every size is one, no process group is needed."""
        return cls(
            1, 1, 1, 0, 0, 0, None, None, None, torch.device(device), None,
            _layout=ParallelConfig(),
        )  # fmt: skip

    @classmethod
    def from_process_group(
        cls,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        device: str | torch.device | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
    ) -> ParallelState:
        """Build the state of these sizes on the initialised default process group: the
        :class:`ParallelConfig` they state, completed for the world
        (:meth:`ParallelConfig.for_world_size`, which checks them), then
        :meth:`from_config`. Every rank must call this with the same arguments."""
        config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_parallel_size=expert_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )
        return cls.from_config(config.for_world_size(_world_size()), device=device, timeout=timeout)

    @classmethod
    def from_config(
        cls,
        config: ParallelConfig,
        *,
        device: str | torch.device | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> ParallelState:
        """Build this rank's state from the initialised default process group and ``config``,
        a layout completed for this world (:meth:`ParallelConfig.for_world_size`, which
        checked it: nothing is checked again here but that its ``t·c·p·d`` is the world's).

        Every rank must call this with the same ``config`` (``expert_parallel_size``: see the
        module docstring). Sub-groups are created with ``timeout`` so that a collective that
        never completes raises instead of hanging.
        """
        world_size = _world_size()
        if config.world_size != world_size:
            raise ConfigError(
                f"the layout's t * c * p * d = {config.world_size} ranks is not the world's "
                f"{world_size}; complete it with ParallelConfig.for_world_size({world_size})"
            )
        t, c = config.tensor_parallel_size, config.context_parallel_size
        pipeline_parallel_size, tensor_parallel_size = config.pipeline_parallel_size, t
        dp, e = config.data_parallel_size, config.expert_parallel_size
        expert_tensor_parallel_size = config.expert_tensor_parallel_size
        backend = dist.get_backend()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        device = torch.device(device)
        options = _group_options(backend, timeout)
        mesh = init_device_mesh(
            device.type,
            (pipeline_parallel_size, dp, c, t),
            mesh_dim_names=("pp", "dp", "cp", "tp"),
            backend_override=(
                {name: options for name in ("pp", "dp", "cp", "tp")}
                if options is not None
                else None
            ),
        )
        coords = mesh.get_coordinate()
        assert coords is not None
        pp_rank, dp_rank, cp_rank, tp_rank = coords

        def group(name: str, size: int) -> dist.ProcessGroup | None:
            return mesh.get_group(name) if size > 1 else None

        data_context = None
        if c > 1:  # every rank makes every group (new_group is collective)
            grid = mesh.mesh.permute(0, 3, 1, 2).reshape(-1, dp * c)  # [(pp, tp), (dp, cp)]
            for ranks in grid.tolist():
                made = dist.new_group(ranks, timeout=timeout)
                if dist.get_rank() in ranks:
                    data_context = made

        me = dist.get_rank()

        def made_groups(rows: list[list[int]]) -> dist.ProcessGroup | None:
            """Make one group per row (collective: every rank makes every group); return
            this rank's, ``None`` when rows have one rank."""
            mine = None
            for ranks in rows:
                if len(ranks) == 1:
                    continue
                made = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    mine = made
            return mine

        pp = pipeline_parallel_size
        # [pp, t, d·c/e, e]: the d·c ranks of equal (pp, tp) in order dp·c + cp, in EP blocks
        experts = mesh.mesh.permute(0, 3, 1, 2).reshape(pp, t, dp * c // e, e)
        ep_group = made_groups(experts.reshape(-1, e).tolist())
        expert_data_group = (
            (data_context if c > 1 else group("dp", dp))
            if e == 1
            else made_groups(experts.transpose(2, 3).reshape(-1, dp * c // e).tolist())
        )
        token_groups: dict[tuple[bool, bool], dist.ProcessGroup | None] = {
            (False, False): None,
            (True, False): group("tp", t),
            (False, True): group("cp", c),
            # the t·c ranks of equal (pp, dp), CP-major then TP
            (True, True): (
                made_groups(mesh.mesh.reshape(pp * dp, c * t).tolist()) if t > 1 and c > 1 else None
            ),
        }
        return cls(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=dp,
            tensor_parallel_rank=tp_rank,
            pipeline_parallel_rank=pp_rank,
            data_parallel_rank=dp_rank,
            tp_group=group("tp", tensor_parallel_size),
            pp_group=group("pp", pipeline_parallel_size),
            dp_group=group("dp", dp),
            device=device,
            mesh=mesh,
            context_parallel_size=c,
            context_parallel_rank=cp_rank,
            cp_group=group("cp", c),
            data_context_group=data_context,
            expert_parallel_size=e,
            expert_parallel_rank=(dp_rank * c + cp_rank) % e,
            ep_group=ep_group,
            expert_data_group=expert_data_group,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            token_groups=token_groups,
            timeout=timeout,
            _layout=config,
        )

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the first pipeline stage (the embedding)."""
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (final LayerNorm, output layer, loss)."""
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    def tensor_parallel_subgroup(self, size: int) -> dist.ProcessGroup | None:
        """The group of the ``size`` consecutive tensor-parallel ranks this rank belongs to
        (blocks ``[k·size, (k+1)·size)`` of every TP group); ``None`` for ``size = 1``.

        Made on first use and kept: every rank of the world must make the first call for a
        ``size`` together (building the model does), as ``new_group`` is collective."""
        if size <= 1 or self.mesh is None:
            return None
        if size not in self._subgroups:
            t = self.tensor_parallel_size
            mine = None
            for row in self.mesh.mesh.reshape(-1, t).tolist():
                for start in range(0, t, size):
                    ranks = row[start : start + size]
                    made = dist.new_group(ranks, timeout=self.timeout)
                    if dist.get_rank() in ranks:
                        mine = made
            self._subgroups[size] = mine
        return self._subgroups[size]

    @property
    def gradient_group(self) -> dist.ProcessGroup | None:
        """The ``d·c`` ranks that hold the same model shard (equal pp, tp): the distributed
        optimizer's gradient reduce-scatter and state shards span it. The ``dp_group`` for
        ``c = 1``."""
        return self.data_context_group if self.context_parallel_size > 1 else self.dp_group

    @property
    def gradient_shards(self) -> int:
        """``d·c``: the ranks of :attr:`gradient_group`, over which the distributed
        optimizer shards its state."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def gradient_shard_rank(self) -> int:
        """This rank's index in :attr:`gradient_group`: ``dp_rank·c + cp_rank``."""
        return self.data_parallel_rank * self.context_parallel_size + self.context_parallel_rank

    @property
    def expert_data_parallel_size(self) -> int:
        """``d·c/e``: the ranks that hold the same experts."""
        return self.gradient_shards // self.expert_parallel_size

    def micro_batch_group(self, sequence_parallel: bool) -> dist.ProcessGroup | None:
        """The ranks that each hold a shard of the same micro-batch's tokens: the TP group
        under sequence parallelism, times the CP group for ``c > 1`` (``None``: this rank
        holds all of them). Token counts summed over it are the micro-batch's."""
        over_tp = sequence_parallel and self.tensor_parallel_size > 1
        over_cp = self.context_parallel_size > 1
        return self.token_groups.get((over_tp, over_cp))

    @property
    def layout(self) -> ParallelConfig:
        """The layout record this state was built from (what activation shapes are built
        from: :meth:`~lightning_sp.model.config.GPTConfig.activation_shape`), passed on
        unchecked; a state built by hand (tests) states its sizes as one."""
        if self._layout is not None:
            return self._layout
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
        )

    @property
    def world_size(self) -> int:
        return (
            self.tensor_parallel_size
            * self.context_parallel_size
            * self.pipeline_parallel_size
            * self.data_parallel_size
        )

    def __repr__(self) -> str:
        return (
            f"ParallelState(tp={self.tensor_parallel_rank}/{self.tensor_parallel_size}, "
            f"pp={self.pipeline_parallel_rank}/{self.pipeline_parallel_size}, "
            f"dp={self.data_parallel_rank}/{self.data_parallel_size}, "
            f"cp={self.context_parallel_rank}/{self.context_parallel_size}, device={self.device})"
        )


def _world_size() -> int:
    """The default process group's size (it must be initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ParallelState.from_config needs torch.distributed to be initialised "
            "(torch.distributed.init_process_group); use ParallelState.single() for one process"
        )
    return dist.get_world_size()
