"""TIDE-RS on CPU/gloo: numerics against a float64 reference, bad input, buffer bytes.

Each test puts fresh random gradients on the unsharded parameters of an FSDP
group and calls FSDP's own ``post_backward`` (the path backward takes), so the
FSDP2 -> ``foreach_reduce`` -> TIDE-RS dispatch is exercised end to end. Every
TIDE-RS output/partial is NaN-poisoned before it is written.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from _harness import spawn
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan_tide.comm.plans.plan import (
    WorldLayout,
    rs_cross_node_peers,
    rs_schedule,
    rs_segments,
)

EPS32 = 2.0**-24


# ---------------------------------------------------------------- pure parts


def test_rs_segments_offsets_and_padding():
    segments, total = rs_segments([13 * 7, 1, 5], [7 * 7, 1, 3])
    assert total == 49 + 1 + 3
    assert [s.out_offset for s in segments] == [0, 49, 50]
    up = segments[0]  # 13 rows of 7 over 2 ranks: 7 + 6 rows
    assert (up.valid(0), up.valid(1), up.src_offset(1)) == (49, 42, 49)
    assert (segments[1].valid(0), segments[1].valid(1)) == (1, 0)
    assert (segments[2].valid(0), segments[2].valid(1)) == (3, 2)


@pytest.mark.parametrize("world,lws,rows", [(2, 2, 2), (4, 2, 1), (8, 4, 3), (8, 8, 2), (6, 1, 2)])
def test_rs_schedule_covers_every_source_once(world, lws, rows):
    layout = WorldLayout(world, lws)
    # receive[(rank, chunk)] = set of local sources whose slice it summed
    received: dict[tuple[int, int], list[int]] = {}
    sent: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        rounds = rs_schedule(layout, rank, rows)
        assert rounds[0].chunk_node == layout.node_of(rank)  # own chunk first
        for rnd in rounds:
            assert len(rnd.recvs) <= min(rows, lws)
            received.setdefault((rank, rnd.chunk_node), []).extend(p for p, _ in rnd.recvs)
            for peer, row in rnd.sends:
                dst = layout.rank_of(layout.node_of(rank), peer)
                sent.setdefault((dst, rnd.chunk_node), []).append(layout.local_of(rank))
                # the receiver expects this rank in the same row of the same round
                peer_rounds = rs_schedule(layout, dst, rows)
                match = [r for r in peer_rounds if r.chunk_node == rnd.chunk_node
                         and r.window == rnd.window]  # fmt: skip
                assert (layout.local_of(rank), row) in match[0].recvs
    for key, sources in received.items():
        assert sorted(sources) == list(range(lws)), key
        assert sorted(sent[key]) == list(range(lws)), key
    for rank in range(world):
        for m in range(layout.num_nodes):
            if m == layout.node_of(rank):
                continue
            send_peer, recv_peer = rs_cross_node_peers(layout, rank, m)
            # the peer I receive from sends to me when it handles my node's chunk
            assert rs_cross_node_peers(layout, recv_peer, layout.node_of(rank))[0] == rank
            assert layout.node_of(send_peer) == m


def test_accumulate_kernel_triton_interpreter_matches_torch():
    """The Triton kernel (run by Triton's CPU interpreter) and the torch fallback
    give bitwise equal results, close to a float64 sum."""
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from torchtitan_tide.comm.base.kernels import accumulate_rows, _torch_accumulate
        g = torch.Generator().manual_seed(0)
        rows = (torch.randn(3, 5000, generator=g) * 10).bfloat16()
        prev = torch.randn(5000, generator=g)
        for accumulate in (False, True):
            for divisor in (1.0, 2.0, 3.0):  # none, exact reciprocal, div_rn
                a, b, c = prev.clone(), prev.clone(), prev.clone()
                accumulate_rows(rows, a, accumulate=accumulate, divisor=divisor, num_ctas=3)
                accumulate_rows(rows, c, accumulate=accumulate, divisor=divisor, num_ctas=0)
                d = prev.clone()  # another launch shape with cache hints
                accumulate_rows(rows, d, accumulate=accumulate, divisor=divisor, num_ctas=0,
                                block=1024, num_warps=4, streaming=True)
                _torch_accumulate(rows, b, accumulate, divisor)
                assert torch.equal(a, b) and torch.equal(c, b) and torch.equal(d, b)
                ref = (prev.double() * accumulate + rows.double().sum(0)) / divisor
                mag = (prev.double().abs() * accumulate + rows.double().abs().sum(0)) / divisor
                assert ((a.double() - ref).abs() <= 5 * 2**-24 * mag + 1e-30).all()
        fp32_rows = torch.randn(1, 77, generator=g)
        a = torch.zeros(77); accumulate_rows(fp32_rows, a, accumulate=True, divisor=2.0)
        assert torch.equal(a, fp32_rows[0] / 2.0)
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "divide, accumulate, streaming, rows_dtype",
    [(0, False, False, "*bf16"), (1, True, True, "*bf16"), (2, False, False, "*fp32")],
)
def test_accumulate_kernel_compiles_for_hopper(divide, accumulate, streaming, rows_dtype):
    """Triton's CPU interpreter does not compile the kernel: compile it to sm_90
    PTX/cubin here (Triton ships ptxas), so a kernel that only the GPU would
    reject fails on CPU CI; the PTX divides only where it must."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torchtitan_tide.comm.base import kernels

    kernel = kernels._triton_kernel()
    runtime = {"rows_ptr": rows_dtype, "row_stride": "i32", "out_ptr": "*fp32", "numel": "i32",
               "divisor": "fp32"}  # fmt: skip
    constexprs = {"DIVIDE": divide, "NUM_ROWS": 2, "ACCUMULATE": accumulate,
                  "BLOCK": kernels._BLOCK, "NUM_PROGRAMS": 7, "STREAMING": streaming}  # fmt: skip
    signature = {name: runtime.get(name, "constexpr") for name in kernel.arg_names}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernels._NUM_WARPS}
    )
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]
    assert ("div.rn.f32" in ptx) == (divide == kernels._DIVIDE_RN)
    assert ("evict_first" in ptx) == streaming


# ---------------------------------------------------------------- multi-process


class Shapes(nn.Module):
    """Uneven dim 0 (13 rows), a 1-element parameter, a 3-D weight."""

    def __init__(self, width: int = 1) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(13 * width, 7))
        self.gate = nn.Parameter(torch.randn(1))
        self.experts = nn.Parameter(torch.randn(4 * width, 3, 5))
        self.unused = nn.Parameter(torch.randn(6 * width))


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _build(
    param_dtype: torch.dtype | None,
    width: int = 1,
    reduce_dtype: torch.dtype | None = torch.float32,
    mesh=None,
) -> nn.Module:
    torch.manual_seed(0)
    model = Shapes(width).to(_device())
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(model, mp_policy=mp, mesh=mesh)
    if _device().type == "cpu":  # gloo has no AVG/PREMUL_SUM
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    return model


def _named_fsdp_params(model: nn.Module) -> list[tuple[str, object]]:
    """(name, FSDPParam): FSDP builds its parameters in ``named_parameters`` order."""
    names = [name for name, _ in model.named_parameters()]
    params = _param_group(model).fsdp_params
    assert len(names) == len(params)
    return list(zip(names, params))


def _param_group(model: nn.Module):
    from torchtitan_tide.comm.fsdp.internals import fsdp_param_groups

    ((_, group),) = fsdp_param_groups(model)
    return group


def _reduce(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """FSDP's backward of the group around the given unsharded gradients: its
    pre_backward (unshard; on torch 2.15 also the per-parameter ``grad_dtype`` autograd
    sees during backward: FSDP2 defers the upcast to the reduce dtype, so a bf16 gradient
    may be set), the gradients set as autograd would leave them, its post_backward."""
    model._get_fsdp_state()._lazy_init()  # what the root's first forward does
    group = _param_group(model)
    group.pre_backward(default_prefetch=False)
    for name, fp in _named_fsdp_params(model):
        if name in grads:
            fp.unsharded_param.grad = grads[name].clone()
    group.post_backward()
    group.finalize_backward()


def _random_grads(model, dtype, gen, skip=("unused",)) -> dict[str, torch.Tensor]:
    out = {}
    for name, fp in _named_fsdp_params(model):
        if name in skip:
            continue
        # Wide dynamic range: fp32 accumulation order matters for the bound.
        out[name] = (
            (
                torch.randn(fp._orig_size, generator=gen)
                * 2.0 ** torch.randint(-8, 8, fp._orig_size, generator=gen)
            )
            .to(dtype)
            .to(_device())
        )
    return out


def _add_reference(
    mine: dict[str, torch.Tensor],
    world: int,
    total: dict[str, torch.Tensor],
    magnitude: dict[str, torch.Tensor],
) -> None:
    """Add every rank's gradients of one reduce, in float64, to the mean ``total`` and to
    ``magnitude`` (mean of |terms|, which bounds the fp32 rounding)."""
    for name, g in mine.items():
        gathered = [torch.empty_like(g, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, g.double())
        total[name] = total.get(name, 0) + sum(gathered) / world
        magnitude[name] = magnitude.get(name, 0) + sum(t.abs() for t in gathered) / world


def _numerics_worker(
    rank: int, world: int, options: dict, param_dtype, reduce_dtype=torch.float32
) -> None:
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import internals as fsdp_internals
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    tide_rs.set_poison(float("nan"))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_tide.comm.fsdp.reduce_scatter").addHandler(handler)
    logging.getLogger("torchtitan_tide.comm.fsdp.reduce_scatter").setLevel(logging.INFO)
    grad_dtype = param_dtype or torch.float32
    model = _build(param_dtype, reduce_dtype=reduce_dtype)
    comm.apply(model, "tide", **options)
    state = _param_group(model)._tide_rs_state
    gen = torch.Generator().manual_seed(100 + rank)
    total: dict[str, torch.Tensor] = {}
    magnitude: dict[str, torch.Tensor] = {}  # sum of |terms| over ranks and reduces
    for _ in range(2):  # the second reduce accumulates into the existing .grad
        mine = _random_grads(model, grad_dtype, gen)
        _reduce(model, mine)
        _add_reference(mine, world, total, magnitude)
        for name, g in mine.items():
            param = dict(model.named_parameters())[name]
            local = param.grad.to_local()
            rows = local.shape[0]
            chunk = -(-g.shape[0] // world)
            ref = total[name][rank * chunk : rank * chunk + rows].cpu()
            # world - 1 fp32 additions, one division, one accumulation into .grad
            bound = (world + 2) * EPS32 * magnitude[name][rank * chunk : rank * chunk + rows].cpu()
            local = local.cpu()
            assert not torch.isnan(local).any(), name
            err = (local.double() - ref).abs()
            assert (err <= bound + 1e-30).all(), (name, err.max().item())
    assert state.calls == 2
    first = [m for m in records if "first reduce" in m]
    assert len(first) == 1 and f"{grad_dtype} gradients" in first[0], records  # one run
    # FSDP2's reduce dtype as each torch defines it: bf16 for an explicit bf16; unset is
    # param_dtype (bf16) on torch <= 2.14 and the fp32 grad_dtype on 2.15
    bf16_reduce = [m for m in records if "reduce dtype resolves to bf16" in m]
    sums_bf16 = reduce_dtype == torch.bfloat16 or (
        reduce_dtype is None and not fsdp_internals.PER_PARAM_GRAD_DTYPE
    )
    assert len(bf16_reduce) == (1 if sums_bf16 else 0), records
    assert dict(model.named_parameters())["unused"].grad is None  # unused: no gradient
    comm.remove(model)
    tide_rs.set_poison(None)


@pytest.mark.parametrize(
    "world,options",
    [
        (2, {}),
        (4, {}),
        (4, {"local_world_size": 2}),
        (4, {"local_world_size": 2, "rs_rows": 1}),
        (4, {"local_world_size": 1, "rs_inflight": 1}),
    ],
    ids=["1x2", "1x4", "2x2", "2x2-rows1", "4x1-inflight1"],
)
def test_tide_rs_matches_float64_sum(world, options):
    spawn(_numerics_worker, world, options, torch.bfloat16)


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, None], ids=["bf16", "unset"])
def test_tide_rs_bf16_reduce_dtype_sums_in_fp32(reduce_dtype):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16 or unset): FSDP2 sums in
    bf16 where its torch resolves the reduce dtype to bf16 (explicit bf16; unset on torch
    <= 2.14); TIDE-RS sums in fp32 (the fp32 bound against the float64 reference, which a
    bf16 sum misses) and says so once per group where FSDP2 would not."""
    spawn(_numerics_worker, 2, {}, torch.bfloat16, reduce_dtype)


def test_tide_rs_fp32_gradients():
    """No mixed precision: fp32 gradients on the wire, still TIDE-RS."""
    spawn(_numerics_worker, 2, {}, None)


def _hsdp_worker(rank: int, world: int) -> None:
    """HSDP (2 replicas x world/2 shards): TIDE-RS on the shard group, FSDP2's all-reduce
    across replicas; a first microbatch without all-reduce keeps a partial sum that the
    second, synced one adds. Checked against the float64 mean over ALL ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    tide_rs.set_poison(float("nan"))
    shards = world // 2
    mesh = init_device_mesh("cpu", (2, shards), mesh_dim_names=("replicate", "shard"))
    model = _build(torch.bfloat16, mesh=mesh)
    comm.apply(model, "tide")
    group = _param_group(model)
    state = group._tide_rs_state
    gen = torch.Generator().manual_seed(300 + rank)
    total: dict[str, torch.Tensor] = {}
    magnitude: dict[str, torch.Tensor] = {}
    for sync in (False, True):
        model.set_requires_all_reduce(sync)
        mine = _random_grads(model, torch.bfloat16, gen)
        _reduce(model, mine)
        _add_reference(mine, world, total, magnitude)
    shard_rank = mesh.get_local_rank("shard")
    for name, param in model.named_parameters():
        if name == "unused":
            continue
        local = param.grad.to_local()
        chunk = -(-total[name].shape[0] // shards)
        rows = local.shape[0]
        ref = total[name][shard_rank * chunk : shard_rank * chunk + rows]
        bound = (
            (world + 4) * EPS32 * magnitude[name][shard_rank * chunk : shard_rank * chunk + rows]
        )
        assert not torch.isnan(local).any(), name
        err = (local.double() - ref).abs()
        assert (err <= bound + 1e-30).all(), (name, err.max().item())
    assert state.calls == 2 and state.group.size() == shards
    # A reduce that must take FSDP2's path while TIDE's partial sum is pending raises
    # (FSDP2 scales partial sums differently): never a silently mis-scaled gradient.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class UserReduceScatter(DefaultReduceScatter):
        pass

    model.set_requires_all_reduce(False)
    _reduce(model, _random_grads(model, torch.bfloat16, gen))
    assert state.partial_from_tide
    model.set_custom_reduce_scatter(UserReduceScatter())
    with pytest.raises(RuntimeError, match="partial sum of microbatches without all-reduce"):
        _reduce(model, _random_grads(model, torch.bfloat16, gen))
    comm.remove(model)
    tide_rs.set_poison(None)


def test_tide_rs_hsdp_with_partial_microbatch():
    spawn(_hsdp_worker, 4)


def _fp16_worker(rank: int, world: int) -> None:
    from torchtitan_tide import comm

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtitan_tide.comm.fsdp.reduce_scatter").addHandler(handler)
    ref, tide = _build(torch.float16), _build(torch.float16)
    comm.apply(tide, "tide")
    gen = torch.Generator().manual_seed(7 + rank)
    grads = _random_grads(ref, torch.float16, gen)
    _reduce(ref, grads)
    _reduce(tide, grads)
    for (name, a), b in zip(ref.named_parameters(), tide.parameters()):
        if a.grad is not None:
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), name
    assert _param_group(tide)._tide_rs_state.calls == 0
    assert any("FSDP2 reduce-scatter" in r and "float16" in r for r in records), records


def test_fp16_gradients_take_fsdp2_path_logged():
    spawn(_fp16_worker, 2)


def _buffer_worker(rank: int, world: int, result) -> None:
    """Bytes of reduce-scatter buffers at a fixed per-rank shard size."""
    from torchtitan_tide import comm

    width = world  # shard per rank stays the same as the world grows
    stock, tide = _build(torch.bfloat16, width), _build(torch.bfloat16, width)
    comm.apply(tide, "tide")
    gen = torch.Generator().manual_seed(rank)
    grads = _random_grads(stock, torch.bfloat16, gen, skip=())
    _reduce(stock, grads)
    _reduce(tide, grads)
    group = _param_group(stock)
    states = group.comm_ctx.__dict__.get("reduce_scatter_states")  # torch >= 2.12
    kept = states[-1] if states else group.comm_ctx.reduce_scatter_state
    stock_bytes = kept.reduce_scatter_input.numel() * kept.reduce_scatter_input.element_size()
    rs = _param_group(tide)._tide_rs_state
    tide_bytes = rs.transport.staging.numel() + sum(p.numel() * 4 for p in rs.buffers.partials)
    if rank == 0:
        result[world] = (stock_bytes, tide_bytes)


def test_first_reduce_line_names_one_dtype_plainly_and_each_run_when_mixed():
    """The first-reduce log: "torch.float32 gradients" for one dtype (what launch logs are
    grepped for), "torch.bfloat16 (6) + torch.float32 (2)" when torch 2.15 mixes them."""
    from types import SimpleNamespace

    from torchtitan_tide.comm.fsdp.reduce_scatter import _dtypes_text

    grads = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2), torch.zeros(3)]
    run = lambda index, shard_numel: (index, 0, 0, SimpleNamespace(shard_numel=shard_numel))
    assert _dtypes_text(grads, [run(1, 2), run(2, 3)]) == "torch.float32"
    assert _dtypes_text(grads, [run(0, 6), run(1, 2)]) == "torch.bfloat16 (6) + torch.float32 (2)"
    assert _dtypes_text(grads, []) is None


def test_rs_buffer_flat_in_world_size():
    import torch.multiprocessing as mp

    manager = mp.Manager()
    result = manager.dict()
    for world in (2, 4, 8):
        spawn(_buffer_worker, world, result)
    stock = {w: result[w][0] for w in (2, 4, 8)}
    tide = {w: result[w][1] for w in (2, 4, 8)}
    assert stock[4] == 2 * stock[2] and stock[8] == 4 * stock[2], stock  # grows with W
    assert tide[2] == tide[4] == tide[8], tide  # rs_rows x shard: flat
    assert tide[8] < stock[8]


def test_which_reduces_take_fsdp2_path():
    """User all-reduce hooks, fp16 gradients, mixed gradient dtypes without a reduce dtype and
    a bf16 reduce dtype that is a cast (fp32 gradients) or whose result stays bf16 keep
    FSDP2's path; HSDP (an all-reduce group) takes TIDE-RS
    (test_tide_rs_hsdp_with_partial_microbatch). Reduce dtypes as FSDP2 passes them: None =
    the gradients' dtype (torch <= 2.14), outputs = the sharded gradients' dtypes."""
    from torchtitan_tide.comm.fsdp.internals import ReduceDtypes
    from torchtitan_tide.comm.fsdp.reduce_scatter import rs_unsupported_reason

    bf16 = [torch.zeros(3, dtype=torch.bfloat16)]
    fp32, bf = torch.float32, torch.bfloat16
    fp32_reduce = ReduceDtypes(fp32, (fp32,))
    assert rs_unsupported_reason(bf16, fp32_reduce) is None
    assert rs_unsupported_reason([torch.zeros(3)], ReduceDtypes(None, (fp32,))) is None  # no MP
    assert rs_unsupported_reason(bf16, fp32_reduce, all_reduce_group=object()) is None
    assert "hook" in rs_unsupported_reason(bf16, fp32_reduce, all_reduce_hook=lambda t: None)
    assert "float16" in rs_unsupported_reason([bf16[0].half()], fp32_reduce)
    # bf16 beside fp32 gradients (torch 2.15, an fp32 reduce): TIDE-RS, one run per dtype;
    # torch <= 2.14 passes no reduce dtype (and its FSDP2 refuses mixed gradients itself)
    mixed = [bf16[0], torch.zeros(3)]
    assert rs_unsupported_reason(mixed, ReduceDtypes(fp32, (fp32,) * 2)) is None
    assert "mixed" in rs_unsupported_reason(mixed, ReduceDtypes(None, (fp32,) * 2))
    assert "reduce dtype" in rs_unsupported_reason(mixed, ReduceDtypes(bf, (fp32,) * 2))
    # bf16 reduce of bf16 gradients into fp32 shards: torch <= 2.14 passes None (policy
    # reduce_dtype unset or = param_dtype), 2.15 passes bf16: TIDE-RS sums in fp32
    assert rs_unsupported_reason(bf16, ReduceDtypes(None, (fp32,))) is None
    assert rs_unsupported_reason(bf16, ReduceDtypes(bf, (fp32,))) is None
    # a bf16 reduce that casts fp32 gradients, or hands bf16 shards over: FSDP2's
    assert "reduce dtype" in rs_unsupported_reason([torch.zeros(3)], ReduceDtypes(bf, (fp32,)))
    assert "reduce dtype" in rs_unsupported_reason(bf16, ReduceDtypes(None, (bf,)))
    assert "reduce dtype" in rs_unsupported_reason(bf16, ReduceDtypes(bf, (None,)))


def test_rs_push_slices_skip_padding():
    """Rank 0 of 1x2 in its second window pushes to peer 1 rank 1's slices: the
    13-row parameter's 6 valid rows of 7, nothing of the 1-element one."""
    from torchtitan_tide.comm.plans.plan import RSSlice, rs_push_slices

    segments, _ = rs_segments([13 * 7, 1], [7 * 7, 1])
    layout = WorldLayout(2, 2)
    window = rs_schedule(layout, 0, rows=1)[1]
    assert rs_push_slices(layout, window, segments) == [RSSlice(1, 0, 0, 49, 0, 42)]


# ---------------------------------------------------------------- bf16 on the wire

EPS_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits), round to nearest


def _bf16_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bits by integer arithmetic (finite values): round the low 16
    bits to nearest, ties to even. Independent of torch's cast."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(torch.int32).to(torch.int16)  # two's complement low 16 bits


def test_round_to_wire_rounds_once_to_nearest_even():
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs
    from torchtitan_tide.comm.fsdp.reduce_scatter import RSBuffers, round_to_wire

    one = 1.0
    ties = [one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), 2.0**100 * (one + 2**-8)]
    near = [one + 2**-8 + 2**-20, one + 2**-8 - 2**-20, 3.0e38, 2.0**-130, -(2.0**-140)]
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4096, generator=gen) * 2.0 ** torch.randint(-60, 60, (4096,), generator=gen)
    partial = torch.cat([torch.tensor(ties + near + [0.0, -0.0]), wide])
    buffers = RSBuffers(inflight=1, wire_dtype=torch.bfloat16)
    tide_rs.set_poison(float("nan"))
    try:
        sent = round_to_wire(partial, buffers)
    finally:
        tide_rs.set_poison(None)
    assert sent.dtype == torch.bfloat16 and sent.data_ptr() == buffers.send.data_ptr()
    assert torch.equal(sent.view(torch.int16), _bf16_nearest_even(partial))
    # Ties go to the even significand: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6.
    assert sent[:3].float().tolist() == [1.0, 1.0 + 2**-6, -1.0]
    err = (sent.double() - partial.double()).abs()
    # One rounding: relative 2^-8 (normal numbers), half of bf16's subnormal spacing below.
    normal = partial.abs() >= 2.0**-126
    relative = EPS_BF16 * partial.double().abs()
    assert (err[normal] <= relative[normal]).all() and (err <= relative + 2.0**-134).all()
    assert round_to_wire(partial, RSBuffers(inflight=1)) is partial  # fp32 wire: as it is
    again = round_to_wire(partial[:10] * 2, buffers)  # the same send buffer, reused
    assert again.data_ptr() == buffers.send.data_ptr() and again.numel() == 10
    # The torch-free itemsizes (simulator) match the dtypes the option selects.
    from torchtitan_tide.comm.fsdp.reduce_scatter import WIRE_DTYPES
    from torchtitan_tide.comm.options import RS_WIRE_ITEMSIZE

    assert {k: v.itemsize for k, v in WIRE_DTYPES.items()} == RS_WIRE_ITEMSIZE


def test_one_sided_wire_slot_is_window_memory_no_peer_writes():
    """The bf16 send buffer of the one-sided phase 2 is a view of the registered window
    (puts read registered memory), disjoint from the fp32 partial ring and from every
    receive region a peer puts into, and holds the largest partial in bf16."""
    from types import SimpleNamespace

    from torchtitan_tide.comm.plans.plan import WorldLayout
    from torchtitan_tide.comm.transports.windows.ring import OneSidedCrossNode, rs_ring_bytes

    inflight, shard_bytes = 2, 1000 * 4
    buf = torch.zeros(rs_ring_bytes(inflight, shard_bytes, wire=True), dtype=torch.uint8)
    window = SimpleNamespace(tensor=buf, ptr=buf.data_ptr(), nbytes=buf.numel())
    rs = OneSidedCrossNode(None, None, window, WorldLayout(4, 1), 0, inflight, shard_bytes,
                           True, "g")  # fmt: skip
    wire = rs.wire_slot(torch.bfloat16)
    start = wire.data_ptr() - buf.data_ptr()
    used = {(rs.ring.send(k), rs.ring.send(k) + rs.region_bytes) for k in range(inflight)}
    used |= {(rs.ring.recv(k), rs.ring.recv(k) + rs.region_bytes) for k in range(inflight)}
    end = start + wire.numel() * 2
    assert wire.dtype == torch.bfloat16 and wire.numel() >= shard_bytes // 4
    assert 0 <= start and end <= buf.numel()
    assert all(end <= lo or hi <= start for lo, hi in used), (start, end, sorted(used))


def _node_partials(
    mine: dict[str, torch.Tensor], world: int, lws: int
) -> dict[str, list[torch.Tensor]]:
    """Per parameter, every node's exact (float64) sum of its ranks' gradients."""
    out = {}
    for name, g in mine.items():
        gathered = [torch.empty_like(g, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, g.double())
        out[name] = [sum(gathered[n * lws : (n + 1) * lws]) for n in range(world // lws)]
    return out


def _wire_worker(rank: int, world: int, lws: int, param_dtype) -> None:
    """Two models reduce the same gradients, fp32 and bf16 on the wire. fp32 wire:
    within the fp32 bound of the float64 mean. bf16 wire: within that plus one bf16
    rounding of every other node's partial (relative 2^-8 of |that partial| / world),
    and not bitwise the fp32-wire result (bitwise it, where every partial is one bf16
    gradient). Phase 2 sends (nodes - 1) x shard x itemsize of the wire dtype."""
    from torchtitan_tide import comm
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    tide_rs.set_poison(float("nan"))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    for name in ("torchtitan_tide.comm.fsdp.reduce_scatter", "torchtitan_tide.comm.fsdp.install"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    nodes, node = world // lws, rank // lws
    grad_dtype = param_dtype or torch.float32
    models = {wire: _build(param_dtype) for wire in ("float32", "bfloat16")}
    for wire, model in models.items():
        comm.apply(model, "tide", local_world_size=lws, rs_wire_dtype=wire)
    states = {wire: _param_group(m)._tide_rs_state for wire, m in models.items()}
    assert states["bfloat16"].buffers.wire_dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(500 + rank)
    total: dict[str, torch.Tensor] = {}
    magnitude: dict[str, torch.Tensor] = {}
    other_nodes: dict[str, torch.Tensor] = {}  # sum over reduces of |other nodes' partials|
    differs = 0
    for step in range(2):  # the second reduce accumulates into the existing .grad
        mine = _random_grads(models["float32"], grad_dtype, gen)
        shard_numel = sum(
            fp._sharded_param_data.numel()
            for name, fp in _named_fsdp_params(models["float32"])
            if name in mine
        )
        sent_before = {wire: s.buffers.sent_bytes for wire, s in states.items()}
        for model in models.values():
            _reduce(model, mine)
        for wire, itemsize in (("float32", 4), ("bfloat16", 2)):
            sent = states[wire].buffers.sent_bytes - sent_before[wire]
            assert sent == (nodes - 1) * shard_numel * itemsize, (wire, sent, shard_numel)
        _add_reference(mine, world, total, magnitude)
        for name, parts in _node_partials(mine, world, lws).items():
            others = sum(p.abs() for n, p in enumerate(parts) if n != node) / world
            other_nodes[name] = other_nodes.get(name, 0) + others
        for name in mine:
            chunk = -(-mine[name].shape[0] // world)
            rows = dict(models["float32"].named_parameters())[name].grad.to_local().shape[0]
            window = slice(rank * chunk, rank * chunk + rows)
            ref = total[name][window]
            fp32_bound = (world + 3) * EPS32 * magnitude[name][window]
            got = {}
            for wire, model in models.items():
                local = dict(model.named_parameters())[name].grad.to_local().double()
                assert not torch.isnan(local).any(), (wire, name, step)
                got[wire] = local
            err32 = (got["float32"] - ref).abs()
            assert (err32 <= fp32_bound + 1e-30).all(), (name, err32.max().item())
            bound16 = EPS_BF16 * other_nodes[name][window] + (1 + EPS_BF16) * fp32_bound
            err16 = (got["bfloat16"] - ref).abs()
            assert (err16 <= bound16 + 1e-30).all(), (name, (err16 / bound16).max().item())
            differs += int(not torch.equal(got["float32"], got["bfloat16"]))
    if lws == 1 and grad_dtype == torch.bfloat16:
        # One rank per node: each partial IS a bf16 gradient, the rounding is exact.
        assert differs == 0, "bf16 wire changed partials that are bf16 already"
    else:
        assert differs > 0, "bf16 wire gave the fp32-wire result bitwise: no rounding ran"
    assert all(s.calls == 2 for s in states.values())
    first = [m for m in records if "first reduce" in m]
    for wire in ("bf16", "fp32"):
        assert any(f"cross-node p2p, wire {wire}" in m for m in first), first
    if rank == 0:  # the install decision lines (rank 0 logs them all)
        decisions = [m for m in records if m.startswith("TIDE group") and "TIDE-RS" in m]
        for wire in ("bf16", "fp32"):
            assert any(f"partials in flight, wire {wire}" in m for m in decisions), decisions
    for model in models.values():
        comm.remove(model)
    tide_rs.set_poison(None)


@pytest.mark.parametrize(
    "world,lws,param_dtype",
    [(4, 2, torch.bfloat16), (4, 1, torch.bfloat16), (2, 1, None)],
    ids=["2x2-bf16-grads", "4x1-bf16-grads", "2x1-fp32-grads"],
)
def test_bf16_wire_within_one_rounding_per_partial(world, lws, param_dtype):
    """[tide] rs_wire_dtype = "bfloat16" against the float64 reference and the fp32
    wire, on several node layouts; fp32 gradients are rounded on the wire too."""
    spawn(_wire_worker, world, lws, param_dtype)
