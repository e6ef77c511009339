"""Layout matrix: stock FSDP2 vs TIDE through TorchTitan's own parallelize functions.

``run_layout(rank, world_size, layout)`` (run it with ``_harness.spawn``) builds one
tiny TorchTitan model (llama3, or the qwen3 MoE for EP) per rank from one seed,
copies it, and parallelizes both copies with the train spec's ``parallelize_fn``
(TorchTitan's ``parallelize_llama`` / ``parallelize_qwen3`` wrapped by
``torchtitan_tide.train_specs.wrap_parallelize``, which calls ``comm.apply`` per
model part): one with ``[tide] comm = "fsdp2"``, and one with ``comm = "tide"`` per
``[tide] local_world_size`` of the layout (one node, and 2 "nodes"). PP
layouts go through TorchTitan's ``pipeline_llm`` (several model parts per rank).

Then, for ``layout.steps`` steps on fresh random tokens (the same on both copies,
different per data-parallel rank): forward + backward on every copy, each parameter's
LOCAL gradient shard compared (bitwise, or ``layout.tolerance`` relative), the
unsharded parameters after every all-gather compared in the order FSDP waited for them
(``FSDPParamGroup.wait_for_unshard``, forward and backward), the losses compared, plain
SGD on all (AdamW would normalize a wrong gradient scale away). TIDE-AG outputs are
NaN-poisoned before every all-gather and checked after;
TIDE-RS outputs and partials are NaN-poisoned before they are written. Finally
every FSDP group is checked against what it should have run: TIDE-AG / TIDE-RS
calls counted per group (wrappers around ``fsdp_patch.tide_all_gather`` /
``reduce_scatter.tide_reduce``) on the process group of the expected mesh dimension as the expected
nodes x ranks, or the FSDP2 path with the expected log line.

``run_layout(..., device=torch.device("cuda", 0))`` runs the same on CUDA (NCCL): the
emulated nodes of ``_emulation.py`` (every rank on GPU 0) use it.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils import _pytree as pytree

# Imported here, in the test process, so forked workers inherit them (each import costs
# seconds per worker on 2 cores).
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.llama3 import Transformer, TransformerModelArgs
from torchtitan.models.llama3.infra.parallelize import parallelize_llama
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.model.model import Qwen3Model

from torchtitan_tide import comm as tide_comm
from torchtitan_tide.comm.fsdp import all_gather as tide_ag
from torchtitan_tide.comm.fsdp import patch as fsdp_patch
from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs
from torchtitan_tide.config import Tide
from torchtitan_tide.device import use_cpu_device
from torchtitan_tide.train import use_cpu_moe_kernels
from torchtitan_tide.train_specs import wrap_parallelize

VOCAB = 64
SEQ = 16
BATCH = 2
LR = 0.5


@dataclass(frozen=True)
class Layout:
    """One parallelism layout of the matrix (``[parallelism]`` etc. of a TorchTitan job).

    ``local_world_sizes``: one TIDE copy per entry (``[tide] local_world_size``: 0 =
    detected, one node on this machine; 1 = every rank its own "node"; 2 = nodes of 2
    ranks), all trained in lockstep with the stock copy in the same processes.
    ``parallelize``: ``"torchtitan"`` (the train spec's function), ``"multi_root"``
    (``fully_shard`` on the embedding, blocks, norm and output, not on the model) or
    ``"replicate"`` (torch's FSDP2-based ``replicate``). ``fsdp2_groups``: FSDP module
    name -> substring of the FSDP2-path line TIDE must log for it (such groups must not
    run TIDE); ``"*"``: every group. ``tolerance``: 0 = bitwise (two ranks add per
    element: one fp32 addition, any order); else relative. ``cpu_offload``: parameters
    marked CPU-offloaded (see :func:`_marked_offloaded`). ``ag_extension``: parameter
    names made :class:`AllGatherExtensionTensor` (FSDP2's all-gather extension, as
    float8 weights use) in both copies. ``microbatches`` > 1 (not with PP): gradient
    accumulation over that many microbatches of a step; ``accumulate``: ``"no_sync"``
    (``set_requires_gradient_sync(False)`` before all but the last: no reduce) or
    ``"no_all_reduce"`` (``set_requires_all_reduce(False)``: HSDP reduce-scatters every
    microbatch and all-reduces the accumulated shard at the last). ``ranks_per_node``:
    ranks per node of the launch, what ``local_world_size`` 0 must detect (0: every rank
    of the group on one node, as on this machine; 1: one rank per node, the emulated nodes
    of ``_emulation.py``). ``expect_transport``: the class name of the TIDE-AG transport
    every TIDE group must use ("" = not checked). ``resync_params``: after each step, copy
    the stock copy's parameters into every TIDE copy, so that each step's gradients are
    compared from equal parameters and the unsharded parameters bitwise (with a tolerance,
    bf16 casts of fp32 parameters one ulp apart can round a bf16 ulp apart and let the
    copies drift past it). ``tide``: more ``[tide]`` keys of every TIDE copy (e.g. a
    transport option), beside ``comm`` and ``local_world_size``. ``frozen``: parameter name
    prefixes frozen (``requires_grad_(False)``) in every copy before parallelizing, as partial
    fine-tuning does. ``n_layers``: transformer blocks of the llama3 model (0: 2 per pipeline
    stage). ``reshard_after_forward``: TorchTitan's ``fsdp_reshard_after_forward`` policy.
    ``prefetch``: ``"default"`` (FSDP2's implicit backward prefetch), ``"explicit"`` (each
    block prefetches the next in forward and the previous in backward) or ``"off"``
    (FSDP2's backward prefetch patched out, in every copy alike). Every TIDE copy's window
    arena must hold the same bytes after every step (``arena_in_use`` per transport).
    """

    model: str = "llama3"
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1F1B"
    ac: str = "none"
    selective_ac_option: str = "op"
    compile: bool = False
    parallelize: str = "torchtitan"
    param_dtype: str = "bfloat16"
    cpu_offload: bool = False
    num_experts: int = 8
    ag_extension: tuple = ()
    local_world_sizes: tuple = (0, 1)
    microbatches: int = 1
    accumulate: str = "no_sync"
    fsdp2_groups: dict = field(default_factory=dict)
    tolerance: float = 0.0
    steps: int = 3
    ranks_per_node: int = 0
    expect_transport: str = ""
    resync_params: bool = False
    tide: dict = field(default_factory=dict)
    frozen: tuple = ()
    n_layers: int = 0
    reshard_after_forward: str = "default"
    prefetch: str = "default"


# ---------------------------------------------------------------- model and config


def job_config_for(layout: Layout):
    jc = JobConfig()
    jc.training.seq_len = SEQ
    jc.training.local_batch_size = BATCH
    jc.training.mixed_precision_param = layout.param_dtype
    p = jc.parallelism
    p.data_parallel_replicate_degree = layout.dp_replicate
    p.data_parallel_shard_degree = layout.dp_shard
    p.tensor_parallel_degree = layout.tp
    p.pipeline_parallel_degree = layout.pp
    p.pipeline_parallel_schedule = layout.pp_schedule
    p.expert_parallel_degree = layout.ep
    p.fsdp_reshard_after_forward = layout.reshard_after_forward
    p.disable_loss_parallel = True  # replicated logits: the test's loss is plain
    jc.activation_checkpoint.mode = layout.ac
    jc.activation_checkpoint.selective_ac_option = layout.selective_ac_option
    jc.compile.enable = layout.compile
    jc.compile.components = ["model"]
    jc.compile.backend = "aot_eager"
    return jc


def model_args_for(layout: Layout):
    if layout.model == "llama3":
        return TransformerModelArgs(
            dim=64, n_layers=layout.n_layers or 2 * layout.pp, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
            multiple_of=32, max_seq_len=SEQ, rope_theta=10000,
        )  # fmt: skip
    if layout.model == "qwen3_moe":
        moe = qwen3_args["debugmodel_moe"]
        return replace(
            moe, vocab_size=VOCAB, max_seq_len=SEQ, head_dim=16, dim=64, n_layers=2,
            n_heads=4, n_kv_heads=2, hidden_dim=96, moe_inter_dim=32,
            moe_args=replace(
                moe.moe_args, num_experts=layout.num_experts, top_k=2, use_grouped_mm=False
            ),
        )  # fmt: skip
    raise ValueError(f"unknown model {layout.model!r}")


def build_model(layout: Layout) -> nn.Module:
    """The same full model on every rank (one seed), weights initialized by TorchTitan."""
    args = model_args_for(layout)
    torch.manual_seed(1234)
    model = (Transformer if layout.model == "llama3" else Qwen3Model)(args)
    with torch.no_grad():
        model.init_weights()
    for name, param in model.named_parameters():
        if name.startswith(tuple(layout.frozen)):
            param.requires_grad_(False)
    assert not layout.frozen or any(not p.requires_grad for p in model.parameters()), layout
    return model


def parallelize_fn_for(layout: Layout) -> Callable:
    """The train spec's parallelize_fn: ``wrap_parallelize`` (``comm.apply`` after it)
    around TorchTitan's function or this module's ``layout.parallelize``."""
    inner = {
        "multi_root": _fully_shard_without_root,
        "replicate": _replicate_blocks,
        "torchtitan": parallelize_llama if layout.model == "llama3" else parallelize_qwen3,
    }[layout.parallelize]
    if layout.cpu_offload:
        inner = _marked_offloaded(inner)
    return wrap_parallelize(inner)


def _marked_offloaded(parallelize: Callable) -> Callable:
    """FSDP2's ``CPUOffloadPolicy`` cannot be built without an accelerator (it pins host
    memory), so on this CPU machine the parameters are marked offloaded as the policy
    marks them (``FSDPParam.offload_to_cpu``, the flag TIDE reads), on both copies;
    FSDP2's offload copies are then CPU-to-CPU identities."""

    def parallelize_offloaded(model: nn.Module, parallel_dims, job_config) -> nn.Module:
        model = parallelize(model, parallel_dims, job_config)
        for _, pg in fsdp_patch.fsdp_param_groups(model):
            for fp in pg.fsdp_params:
                fp.offload_to_cpu = True
        return model

    return parallelize_offloaded


def _fully_shard_without_root(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """``fully_shard`` on the embedding, each block, norm and output, NOT on the model:
    every one of them is its own FSDP root (own reduce-scatter stream in FSDP2)."""
    training = job_config.training
    kw = {
        "mesh": parallel_dims.get_mesh("fsdp"),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        ),
    }
    fully_shard(model.tok_embeddings, **kw)
    for block in model.layers.values():
        fully_shard(block, **kw)
    fully_shard(model.norm, **kw)  # one module per root: FSDP2 wants a single root
    fully_shard(model.output, **kw)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
    return model


class AllGatherExtensionTensor(torch.Tensor):
    """A parameter with FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``), as torchao's float8 training weights have: it all-gathers
    its data cast to ``param_dtype`` and unshards into a plain tensor. Every other op
    runs on the wrapped data (the optimizer's update, FSDP's sharding ops)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"AllGatherExtensionTensor({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return AllGatherExtensionTensor(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        if func._schema.is_mutable or func.__name__.endswith("_"):
            return args[0] if args and isinstance(args[0], cls) else out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self._data.dtype
        return (self._data.to(dtype),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # FSDP gathered into the storage we returned before
            if out.data_ptr() != data.data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(data)
            return None
        return data, (data,)


def with_ag_extension(model: nn.Module, names: tuple) -> None:
    for name in names:
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        data = getattr(module, attr).detach()
        setattr(module, attr, nn.Parameter(AllGatherExtensionTensor(data)))


def _replicate_blocks(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torch's FSDP2-based ``replicate`` (``replicate_with_fsdp``) on each block and the
    model over the ``dp_replicate`` mesh: FSDP param groups with a replicate-only mesh."""
    mesh = parallel_dims.get_mesh("dp_replicate")
    for block in model.layers.values():
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    return model


# ---------------------------------------------------------------- what TIDE ran


@dataclass
class TideRecord:
    """TIDE calls and log lines of one process."""

    ag: Counter = field(default_factory=Counter)  # id(FSDPParam) -> TIDE-AG calls
    rs: Counter = field(default_factory=Counter)  # id(FSDPParam) -> TIDE-RS calls
    # id(FSDPParam) -> (process group, WorldLayout) of its last TIDE-AG / TIDE-RS call
    ag_seen: dict = field(default_factory=dict)
    rs_seen: dict = field(default_factory=dict)
    ag_transport: dict = field(default_factory=dict)  # id(FSDPParam) -> transport class name
    transports: dict = field(default_factory=dict)  # id(transport) -> the TIDE-AG transport
    logs: list = field(default_factory=list)


class _ListHandler(logging.Handler):
    def __init__(self, out: list) -> None:
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


@contextmanager
def watch_tide() -> Iterator[TideRecord]:
    """Count TIDE-AG / TIDE-RS calls per FSDP parameter, NaN-poison TIDE's outputs
    (TIDE-AG: the unsharded storage before the transport writes it, checked after;
    TIDE-RS: every output and partial before it is written), capture the
    ``torchtitan_tide`` and ``torchtitan`` log lines."""
    rec = TideRecord()
    orig_ag, orig_rs = fsdp_patch.tide_all_gather, tide_rs.tide_reduce

    def counted_ag(state, fsdp_params, group, *args, **kwargs):
        for fp in fsdp_params:
            rec.ag[id(fp)] += 1
            rec.ag_seen[id(fp)] = (group, state.plan.layout)
            rec.ag_transport[id(fp)] = type(state.transport).__name__
        rec.transports[id(state.transport)] = state.transport
        return orig_ag(state, fsdp_params, group, *args, **kwargs)

    def counted_rs(state, fsdp_params, *args, **kwargs):
        for fp in fsdp_params:
            rec.rs[id(fp)] += 1
            rec.rs_seen[id(fp)] = (state.group, state.layout)
        return orig_rs(state, fsdp_params, *args, **kwargs)

    def poison(outputs: list[torch.Tensor]) -> None:
        for o in outputs:
            o.fill_(float("nan"))

    def written(outputs: list[torch.Tensor]) -> None:
        for o in outputs:
            assert not torch.isnan(o).any().item(), "TIDE-AG left an element unwritten"

    handler = _ListHandler(rec.logs)
    loggers = [logging.getLogger(n) for n in ("torchtitan_tide", "torchtitan")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)
    fsdp_patch.tide_all_gather, tide_rs.tide_reduce = counted_ag, counted_rs
    tide_ag.set_debug_hooks(before=poison, after=written)
    tide_rs.set_poison(float("nan"))
    try:
        yield rec
    finally:
        fsdp_patch.tide_all_gather, tide_rs.tide_reduce = orig_ag, orig_rs
        tide_ag.set_debug_hooks()
        tide_rs.set_poison(None)
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_tide_ran(
    parts: list[nn.Module], rec: TideRecord, layout: Layout, dims, lws: int, label: str = ""
) -> None:
    """Every FSDP group of the TIDE model ran what it should: TIDE-AG and TIDE-RS on
    its own all-gather group, whose ranks are those of the ``fsdp`` mesh dimension
    (``efsdp`` for routed experts under EP), as ``group size / lws`` nodes of ``lws``
    ranks (``lws`` 0: detected, ``layout.ranks_per_node`` ranks per node, or one node
    when that is 0), TIDE-AG on ``layout.expect_transport`` where it is set; groups
    named in ``layout.fsdp2_groups`` took FSDP2's path with their logged reason."""
    meshes = {name: dims.get_optional_mesh(name) for name in ("fsdp", "efsdp")}
    ranks = {name: _ranks(m.get_group()) if m is not None else None for name, m in meshes.items()}
    log = "\n".join(rec.logs)
    seen = 0
    for part in parts:
        for fqn, pg in fsdp_patch.fsdp_param_groups(part):
            seen += 1
            first = pg.fsdp_params[0]
            ag_calls, rs_calls = rec.ag[id(first)], rec.rs[id(first)]
            where = f"{label}rank {dist.get_rank()} group {fqn!r}"
            reason = layout.fsdp2_groups.get(fqn, layout.fsdp2_groups.get("*"))
            if reason is not None:
                assert ag_calls == 0, f"{where}: TIDE-AG ran, expected FSDP2's path"
                assert rs_calls == 0, f"{where}: TIDE-RS ran, expected FSDP2's path"
                # install's decisions are logged by rank 0 (others only where theirs differ)
                if dist.get_rank() == 0:
                    line = f"{fqn}: FSDP2 path ("
                    hits = [m for m in rec.logs if line in m and reason in m]
                    assert hits, f"{where}: no log line {line!r} with {reason!r} in:\n{log}"
                continue
            group = pg._all_gather_process_group
            expected = ranks["efsdp" if fqn.endswith("moe.experts") else "fsdp"]
            assert _ranks(group) == expected, f"{where}: FSDP group {_ranks(group)} != {expected}"
            assert ag_calls > 0, f"{where}: TIDE-AG never ran; log:\n{log}"
            trained = any(fp.sharded_param.requires_grad for fp in pg.fsdp_params)
            if not trained:  # a frozen group has no gradient to reduce
                assert rs_calls == 0, f"{where}: TIDE-RS ran on a frozen group"
                continue
            assert rs_calls > 0, f"{where}: TIDE-RS never ran; log:\n{log}"
            per_node = lws or layout.ranks_per_node or group.size()
            nodes = (group.size() // per_node, per_node)
            if layout.expect_transport:
                used = rec.ag_transport[id(first)]
                assert used == layout.expect_transport, (
                    f"{where}: TIDE-AG ran on {used}, not {layout.expect_transport}"
                )
            for which, (used, world) in (("AG", rec.ag_seen[id(first)]),
                                         ("RS", rec.rs_seen[id(first)])):  # fmt: skip
                assert used is group, f"{where}: TIDE-{which} ran on another process group"
                got = (world.num_nodes, world.local_world_size)
                assert got == nodes, (
                    f"{where}: TIDE-{which} ran as {got} nodes x ranks, not {nodes}"
                )
    assert seen > 0, "the TIDE model has no FSDP group"


# ---------------------------------------------------------------- the run


def check_built(parts: list[nn.Module], layout: Layout) -> None:
    """The parallelize function built what the layout names (compiled blocks, AC
    wrappers, one model part per pipeline stage of this rank)."""
    blocks = [b for part in parts for b in part.layers.values()]
    assert blocks, "no transformer block on this rank"
    if layout.compile:
        compiled = [isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks]
        assert all(compiled), f"blocks not compiled: {compiled}"
    if layout.ac != "none":
        wrapped = [isinstance(b, CheckpointWrapper) for b in blocks]
        assert all(wrapped), f"blocks without activation checkpointing: {wrapped}"
    if layout.pp > 1:
        per_rank = 2 if layout.pp_schedule.startswith("Interleaved") else 1
        assert len(parts) == per_rank, f"{len(parts)} model parts, expected {per_rank}"


def _same(a: torch.Tensor, b: torch.Tensor, tolerance: float, what: str) -> None:
    assert not torch.isnan(b).any(), f"{what}: TIDE has NaN (an element left unwritten)"
    if tolerance == 0.0:
        assert torch.equal(a, b), f"{what}: not bitwise equal, max |diff| {(a - b).abs().max()}"
    else:
        torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance, msg=what)


class UnshardedLog:
    """The unsharded parameters of one model after every all-gather, in the order FSDP
    waited for them: each FSDP group's ``wait_for_unshard`` (forward and backward, TIDE's
    all-gathers and FSDP2's alike) is wrapped to append ``(name, clone)`` for each of its
    parameters when an all-gather was pending (FSDP2 internals: ``_all_gather_result``,
    ``FSDPParam.unsharded_param``; the clone runs on the stream FSDP just made wait)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.seen: list[tuple[str, torch.Tensor]] = []
        for part in parts:
            for fqn, pg in fsdp_patch.fsdp_param_groups(part):
                pg.wait_for_unshard = self._wrap(fqn, pg, pg.wait_for_unshard)

    def _wrap(self, fqn: str, pg, wait: Callable[[], None]) -> Callable[[], None]:
        def wait_and_record() -> None:
            gathered = bool(pg._all_gather_result)
            wait()
            if gathered:
                for i, fp in enumerate(pg.fsdp_params):
                    name = f"{fqn or '<root>'}[{i}]"
                    self.seen.append((name, fp.unsharded_param.detach().clone()))

        return wait_and_record

    def take(self) -> list[tuple[str, torch.Tensor]]:
        seen, self.seen = self.seen, []
        return seen


def compare_unsharded(
    a: list[tuple[str, torch.Tensor]], tide: UnshardedLog, tol: float, label: str
) -> int:
    """Compare the stock copy's unsharded parameters ``a`` (an :meth:`UnshardedLog.take`)
    with those ``tide`` recorded since its last take; returns how many were compared."""
    b = tide.take()
    assert len(a) == len(b), f"{label}: {len(a)} stock vs {len(b)} TIDE unsharded parameters"
    for (name, p_ref), (name_t, p_tide) in zip(a, b):
        assert name == name_t, f"{label}: all-gather order differs: {name} vs {name_t}"
        _same(p_ref, p_tide, tol, f"{label} unsharded {name}")
    return len(a)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def compare_grads(ref: list[nn.Module], tide: list[nn.Module], tol: float, label: str) -> int:
    """Compare every parameter's local gradient shard; returns how many were compared."""
    n = 0
    for part_ref, part_tide in zip(ref, tide, strict=True):
        named = zip(part_ref.named_parameters(), part_tide.named_parameters(), strict=True)
        for (name, p_ref), (name_t, p_tide) in named:
            assert name == name_t, (name, name_t)
            what = f"{label} grad of {name}"
            assert (p_ref.grad is None) == (p_tide.grad is None), f"{what}: None on one side"
            if p_ref.grad is None:
                continue
            _same(_local(p_ref.grad), _local(p_tide.grad), tol, what)
            n += 1
    return n


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())


class _Copy:
    """One parallelized copy: its model parts, optimizer and (PP) schedule."""

    def __init__(
        self, base: nn.Module, layout: Layout, dims, tide: dict, device: torch.device
    ) -> None:
        jc = job_config_for(layout)
        jc.tide = Tide(**tide)
        self.layout = layout
        fn = parallelize_fn_for(layout)
        model = copy.deepcopy(base)
        with_ag_extension(model, layout.ag_extension)
        self.schedule = None
        if layout.pp > 1:
            self.schedule, self.parts, self.first, self.last = pipeline_llm(
                model, dims, jc, device, model_args_for(layout), fn, loss_fn
            )
        else:
            self.parts = [fn(model, dims, jc)]
        check_built(self.parts, layout)
        if layout.prefetch == "explicit":
            _explicit_prefetch(self.parts)
        params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(params, lr=LR)
        self.unsharded = UnshardedLog(self.parts)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step's forward and backward (all microbatches); the losses."""
        losses: list[torch.Tensor] = []
        if self.schedule is None:
            model, n = self.parts[0], self.layout.microbatches
            for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
                last = i == n - 1
                if n > 1 and self.layout.accumulate == "no_sync":
                    model.set_requires_gradient_sync(last)
                elif n > 1:  # "no_all_reduce": reduce-scatter each microbatch (HSDP)
                    model.set_requires_all_reduce(last)
                loss = loss_fn(model(xm), ym)
                loss.backward()
                losses.append(loss.detach())
            return torch.stack(losses)
        self.schedule.step(
            x if self.first else None, target=y if self.last else None, losses=losses,
            return_outputs=False,
        )  # fmt: skip
        return torch.stack(losses).detach() if self.last else None

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _explicit_prefetch(parts: list[nn.Module]) -> None:
    """Each block prefetches the next in forward and the previous in backward."""
    for part in parts:
        blocks = list(part.layers.values())
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])


@contextmanager
def _backward_prefetch(layout: Layout) -> Iterator[None]:
    """``layout.prefetch == "off"``: FSDP2's implicit backward prefetch patched out."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if layout.prefetch != "off":
        yield
        return
    original = FSDPParamGroup._backward_prefetch
    FSDPParamGroup._backward_prefetch = lambda self: None
    try:
        yield
    finally:
        FSDPParamGroup._backward_prefetch = original


def arena_in_use(rec: TideRecord) -> dict[int, int]:
    """Bytes held in each in-place window arena TIDE ran on (id of the transport -> bytes)."""
    return {key: t.arena_in_use for key, t in rec.transports.items()
            if getattr(t, "in_place", None) is not None}  # fmt: skip


def _copy_params(src: list[nn.Module], dst: list[nn.Module]) -> None:
    with torch.no_grad():
        for part_src, part_dst in zip(src, dst, strict=True):
            for p_src, p_dst in zip(part_src.parameters(), part_dst.parameters(), strict=True):
                _local(p_dst).copy_(_local(p_src))


def run_layout(
    rank: int, world_size: int, layout: Layout, device: torch.device | None = None
) -> TideRecord:
    """Stock FSDP2 vs TIDE on ``layout`` (see the module docstring); asserts on failure.
    ``device``: None = CPU (gloo, TorchTitan switched to "cpu"); a CUDA device: the
    models live there (NCCL; the caller set the process's device). Returns what TIDE
    ran (calls and log lines of this process)."""
    if device is None:
        device = torch.device("cpu")
        use_cpu_device()  # TorchTitan's device_type "cpu" (it falls back to "cuda" otherwise)
        use_cpu_moe_kernels()  # (forked workers: the patches end with them)
    dims = ParallelDims(
        dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=1, tp=layout.tp,
        pp=layout.pp, ep=layout.ep, etp=1, world_size=world_size,
    )  # fmt: skip
    dims.build_mesh()
    base = build_model(layout).to(device)
    # Dense mesh order (pp, dp_replicate, fsdp, tp): the data-parallel rank.
    dp_rank = (rank // layout.tp) % (dims.dp_replicate * dims.dp_shard)
    ref = _Copy(base, layout, dims, {"comm": "fsdp2"}, device)
    # All-gathers copy: bitwise, unless the parameters were allowed to drift apart.
    ag_tol = 0.0 if layout.resync_params else layout.tolerance
    arenas: list[dict[int, int]] = []
    with watch_tide() as rec, _backward_prefetch(layout):
        tides = {
            lws: _Copy(
                base, layout, dims, {**layout.tide, "comm": "tide", "local_world_size": lws}, device
            )
            for lws in layout.local_world_sizes
        }
        for step in range(layout.steps):
            x, y = (t.to(device) for t in _batch(step, dp_rank))
            l_ref = ref.forward_backward(x, y)
            unsharded_ref = ref.unsharded.take()
            for lws, tide in tides.items():
                l_tide = tide.forward_backward(x, y)
                what = f"[tide local_world_size={lws}] rank {rank} step {step}"
                assert compare_grads(ref.parts, tide.parts, layout.tolerance, what) > 0
                assert compare_unsharded(unsharded_ref, tide.unsharded, ag_tol, what) > 0
                if l_ref is not None:
                    _same(l_ref, l_tide, layout.tolerance, f"{what} loss")
            ref.step()
            for tide in tides.values():
                tide.step()
                if layout.resync_params:
                    _copy_params(ref.parts, tide.parts)
            arenas.append(arena_in_use(rec))
        # TIDE-AG in place gives back every arena range it took, each step: the arena holds
        # the same bytes after every step (a range lost per step would grow it until it ran
        # full and the all-gathers fell back to copies)
        assert all(a == arenas[0] for a in arenas), f"rank {rank}: arena bytes per step {arenas}"
        for lws, tide in tides.items():
            check_tide_ran(tide.parts, rec, layout, dims, lws, f"[tide local_world_size={lws}] ")
    for tide in tides.values():  # on every rank alike: TIDE's own communicators end
        for part in tide.parts:
            tide_comm.remove(part)
    return rec
