"""What TIDE's multi-node path costs the SMs, the copy engines and the wire, on ONE GPU.

    python scripts/bench/bench_cross_node.py --out-dir bench/results [--layout 2x2]
        [--emulation one_node]

``--layout NxL`` (default 2x1): N*L ranks share GPU 0, TIDE told ``local_world_size = L``
(N "nodes" of L ranks). ``--emulation one_node`` (default): NCCL sees one node
(``NCCL_MULTI_RANK_GPU_ENABLE=1``; needs NCCL >= 2.30 in torch's place) and moves
one-sided puts by copy engine; ``nodes`` (L = 1 only): each rank its own NCCL host
(``NCCL_HOSTID``, sockets on loopback; no host RMA, so no one-sided variant).

Variants (one spawn each, the same Llama-shaped bf16 model and data): ``fsdp2`` (stock
all-gather / reduce-scatter kernels), ``tide_p2p`` (``cross_node_transport = "p2p"``:
TIDE over NCCL send/recv, node-local too where ranks share the GPU), ``tide_one_sided``
(NCCL windows: put/signal on both tiers, TIDE-RS phase 2 on its ring), each with the fp32
and the bf16 TIDE-RS wire, TIDE with its default options (``--storage-swap ctypes``: ``[tide]
ag_storage_swap = "ctypes"``, which a torch without ``UntypedStorage._swap_data_ptr_``, 2.11,
needs for TIDE-AG in place). ``--in-place-compare`` adds the one-sided fp32 variant twice
with ``[tide] ag_in_place_groups`` set: ``tide_one_sided_in_place_fp32_wire`` (4: TIDE-AG
puts every shard straight into the parameters' storage on the window's arena, at any N x L)
and ``tide_one_sided_placement_fp32_wire`` (0: packed shards placed with copies). The tide
rows count the all-gathers that ran in place, the placement copies the transport issued,
and the host time spent issuing TIDE-AG (the window transport's bind and rounds) per
all-gather and TIDE-RS per reduce. Per step (median of ``--steps`` profiled steps after
warm-up),
per rank: NCCL kernels launched, their kernel-ms and SM-ms (kernel time x min(1, CTAs /
SMs)), copies and the bytes they moved (profiled memcpy events: every copy is one read and
one write of HBM here), and the bytes put on the cross-node wire (TIDE: counted by its
transports, rail puts and phase 2; fsdp2: a ring over the N*L ranks in node order crosses
nodes N times, so (N/W)(W-1) shards per collective per rank on average: a model, said so).
The one-sided variant also records the ops of one all-gather as the window transport ran
them (``window_rounds``: which stream waits on which peer) and the profiled copies of a
step on their streams (a PNG timeline, zoomed on the cross-node puts and the fan-out; each
lane named by TIDE's stream name, found by a marker copy per stream in a profile of its
own), with rank 0's copy time on the fan-out stream and how much of it ran while a
cross-node put did (``fan_beside_put_ms``).
The ranks share one GPU and "the network" is a copy or a loopback socket: step times from
here are no cluster figure and are not reported; kernel counts, SM-ms and bytes are. From 16
ranks (2x8) NCCL gets 1 MiB buffers and 4 channels unless set (``SHARED_GPU_NCCL``, recorded
in the result's ``args.nccl_env``): its default buffers for every process do not fit one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import harness

EMULATION_ENV = {
    "one_node": (("NCCL_MULTI_RANK_GPU_ENABLE", "1"),),
    "nodes": (("NCCL_HOSTID", "emunode{rank}"), ("NCCL_SOCKET_IFNAME", "lo"),
              ("NCCL_IB_DISABLE", "1")),
}  # fmt: skip
# From this many ranks on the one GPU NCCL's default buffers of every process's communicators
# no longer fit 80 GB (2x8 in place: "ncclSignal ... Cuda failure 'out of memory'" at the
# first reshard, 2026-12-07): smaller buffers and fewer channels, unless the caller set them.
SHARED_GPU_RANKS = 16
SHARED_GPU_NCCL = (("NCCL_BUFFSIZE", "1048576"), ("NCCL_MAX_NCHANNELS", "4"))


def _shared_gpu_env(ranks: int) -> tuple[tuple[str, str], ...]:
    """The NCCL settings added for ``ranks`` processes on one GPU (none below
    :data:`SHARED_GPU_RANKS`; a variable already set in the environment is left alone)."""
    if ranks < SHARED_GPU_RANKS:
        return ()
    return tuple((key, value) for key, value in SHARED_GPU_NCCL if key not in os.environ)


class _Block(nn.Module):
    """A Llama-shaped feed-forward block (RMSNorm, SwiGLU)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Model(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _build(args: argparse.Namespace, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _Model(args.vocab, args.dim, args.hidden, args.layers).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _sent_bytes(model: nn.Module) -> int:
    """Cross-node bytes this rank's TIDE transports posted so far (AG + RS phase 2)."""
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    seen, total = set(), 0
    for _, group in fsdp_patch.fsdp_param_groups(model):
        for obj in (group._tide_ag_state.transport, group._tide_rs_state.buffers):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.sent_bytes
    return total


def _fsdp2_wire_bytes(model: nn.Module, world: int, nodes: int) -> int:
    """Ring all-gather (bf16) and reduce-scatter (fp32) bytes one rank sends to other nodes
    per step, on average: (W-1) padded shards per collective, N of the ring's W hops cross
    nodes; each layer group is gathered twice (forward, and backward after resharding), the
    root once (FSDP2 keeps it unsharded after forward), and every group is reduced once."""
    from torchtitan_tide.comm.fsdp import internals as fsdp_internals

    total = 0
    for fqn, group in fsdp_internals.fsdp_param_groups(model):
        shard_numel = sum(fp._sharded_param_data.numel() for fp in group.fsdp_params)
        gathers = 1 if fqn in ("", "<root>") else 2
        total += (world - 1) * shard_numel * (gathers * 2 + 4)
    return total * nodes // world if nodes > 1 else 0


def _in_place_counts(model: nn.Module) -> dict[str, int]:
    """Running totals of this rank's window transports: all-gathers delivered in place into
    parameter storage and placement copies (empty off the window transport)."""
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    seen, totals = set(), {}
    for _, group in fsdp_patch.fsdp_param_groups(model):
        counters = getattr(group._tide_ag_state.transport, "counters", None)
        if not hasattr(counters, "in_place_all_gathers") or id(counters) in seen:
            continue
        seen.add(id(counters))
        for key in ("in_place_all_gathers", "placed_copies"):
            totals[key] = totals.get(key, 0) + getattr(counters, key)
    return totals


def _time_host_issue(model: nn.Module) -> dict:
    """Wrap this rank's TIDE entry points to add the host seconds spent issuing them: TIDE-AG
    (the window transport's bind and rounds, or the transport's gather: not FSDP2's or the
    run-ahead bound's waits) and TIDE-RS (its whole reduce). Returns the running totals."""
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch
    from torchtitan_tide.comm.fsdp import reduce_scatter as tide_rs

    host: dict = {}

    def timed(fn, key: str):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                host[key + "_s"] = host.get(key + "_s", 0.0) + time.perf_counter() - started
                if key != "bind":
                    host[key + "_n"] = host.get(key + "_n", 0) + 1

        return run

    seen = set()
    for _, group in fsdp_patch.fsdp_param_groups(model):
        transport = group._tide_ag_state.transport
        if id(transport) in seen:
            continue
        seen.add(id(transport))
        transport.gather = timed(transport.gather, "ag")
        if hasattr(transport, "bind_in_place"):
            transport.bind_in_place = timed(transport.bind_in_place, "bind")
    tide_rs.tide_reduce = timed(tide_rs.tide_reduce, "rs")
    return host


def _host_ms(host: dict) -> dict:
    """Host ms per all-gather (bind + rounds) and per reduce of one step."""
    ags, reduces = host.get("ag_n", 0), host.get("rs_n", 0)
    return {
        "all_gathers": ags, "reduces": reduces,
        "host_ms_per_ag": 1e3 * (host.get("ag_s", 0.0) + host.get("bind_s", 0.0)) / max(ags, 1),
        "host_ms_per_rs": 1e3 * host.get("rs_s", 0.0) / max(reduces, 1),
    }  # fmt: skip


def _op_line(op) -> str:
    """One window op as the schedule table prints it."""
    kind = type(op).__name__
    if kind == "Fork":
        return f"fork   {op.dst} waits for {op.src}"
    if kind == "Put":
        return f"put    [{op.stream}] {op.nbytes} B -> group rank {op.peer} @ {op.dst}"
    if kind == "Wait":
        return f"wait   [{op.stream}] {op.count} signal(s) from group rank {op.peer}"
    if kind == "Place":
        ranks = ", ".join(str(r) for _, r, _ in op.entries)
        return f"place  [{op.stream}] shards of ranks {ranks} into the parameters"
    if kind == "PackOwn":
        return f"pack   [{op.stream}] own shards cast into the window @ {op.dst}"
    return f"{kind.lower():6} [{op.stream}]"


def _last_ag_ops(model: nn.Module) -> list[str]:
    from torchtitan_tide.comm.fsdp import patch as fsdp_patch

    for fqn, group in fsdp_patch.fsdp_param_groups(model):
        transport = group._tide_ag_state.transport
        if fqn and hasattr(transport, "slots"):
            return [_op_line(op) for op in transport.slots.last_ag_ops]
    return []


def _event_stream(event: dict):
    """The stream number a profile's device row names (CUPTI's stream id)."""
    return (event.get("args") or {}).get("stream", event.get("tid"))


def _copy_lanes(events: list[dict]) -> list[dict]:
    """The step's copies and kernels as (stream, start, end) in ms from the first event."""
    if not events:
        return []
    t0 = min(e["ts"] for e in events)
    lanes = []
    for e in events:
        kind = common.classify_device_event(e["name"])
        if kind in ("memcpy", "other_kernel", "nccl_kernel"):
            stream = _event_stream(e)
            lanes.append({"stream": stream, "kind": kind, "start_ms": (e["ts"] - t0) / 1e3,
                          "end_ms": (e["ts"] + e["dur"] - t0) / 1e3})  # fmt: skip
    return lanes


MARKER_BYTES = 1000  # the marker copy of the i-th named stream moves MARKER_BYTES + i bytes


def _marker_names(events: list[dict], names: list[str]) -> dict[str, str]:
    """Stream number -> name from a profile of one marker copy per name (``names[i]``'s of
    ``MARKER_BYTES + i`` bytes); a number two names claim is left out."""
    found: dict[str, set[str]] = {}
    for e in events:
        size = (e.get("args") or {}).get("bytes")
        if common.classify_device_event(e["name"]) == "memcpy" and isinstance(size, int):
            index = size - MARKER_BYTES
            if 0 <= index < len(names):
                found.setdefault(str(_event_stream(e)), set()).add(names[index])
    return {stream: next(iter(n)) for stream, n in found.items() if len(n) == 1}


def _stream_names(device: torch.device) -> dict[str, str]:
    """The profile's stream numbers named: a profile of its own (the measured step's counts
    stay untouched) with one device-to-device copy of a distinct size on the compute stream
    and on each of TIDE's streams made so far (``comm.base.streams.made_on``); CUPTI's
    stream ids hold for the process."""
    from torchtitan_tide.comm.base import streams as tide_streams

    on = {"compute": torch.cuda.current_stream(device), **tide_streams.made_on(device)}
    names = sorted(on)
    src = torch.zeros(MARKER_BYTES + len(names), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for index, name in enumerate(names):
            with torch.cuda.stream(on[name]):
                size = MARKER_BYTES + index
                dst[:size].copy_(src[:size])
        torch.cuda.synchronize(device)
    return _marker_names(_device_events(prof), names)


def _device_events(prof: torch.profiler.profile) -> list[dict]:
    """A finished CUDA profile's device rows (kernels, copies, memsets), by start time."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        return common.device_events(common.load_chrome_trace(trace))


def _zoom_window(lanes: list[dict], width_ms: float,
                 wanted: tuple[str, ...] = ()) -> tuple[float, float] | None:  # fmt: skip
    """The first ``width_ms`` window that holds copies on the most streams (the ranks share
    one GPU, so a step is short bursts between long waits for the other ranks' turns).
    ``wanted`` (stream numbers as text, e.g. the put and fan-out streams): the window with
    copies on the most of those, then the most copies on them, then on the most streams."""
    copies = sorted((x for x in lanes if x["kind"] == "memcpy"), key=lambda x: x["start_ms"])
    best, best_score = None, (0, 0, 0)
    for first in copies:
        end = first["start_ms"] + width_ms
        inside = [x for x in copies if first["start_ms"] <= x["start_ms"] < end]
        on_wanted = [x for x in inside if str(x["stream"]) in wanted]
        score = (len({x["stream"] for x in on_wanted}), len(on_wanted),
                 len({x["stream"] for x in inside}))  # fmt: skip
        if score > best_score:
            best, best_score = (first["start_ms"], end), score
    return best


def _busy(lanes: list[dict], stream: str) -> list[tuple[float, float]]:
    """The time spans in which ``stream`` (number as text) has a copy running, merged."""
    spans = sorted((x["start_ms"], x["end_ms"]) for x in lanes
                   if x["kind"] == "memcpy" and str(x["stream"]) == stream)  # fmt: skip
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _put_and_fan(names: dict[str, str]) -> tuple[str | None, str | None]:
    """The stream numbers (as text) of TIDE-AG's cross-node puts and of the fan-out
    (``tide_fan``) among ``names`` (stream number -> TIDE's stream); None where unnamed."""
    from torchtitan_tide.comm.transports.windows.ring import AG_PUT_STREAM

    by_name = {name: stream for stream, name in names.items()}
    return by_name.get(AG_PUT_STREAM), by_name.get("tide_fan")


def _fan_beside_puts(lanes: list[dict], names: dict[str, str]) -> dict[str, float]:
    """Rank 0's copy time on the fan-out stream (``tide_fan``), on TIDE-AG's cross-node put
    stream, and the time both ran at once (ms; {} when the lanes are not named)."""
    put_stream, fan_stream = _put_and_fan(names)
    if put_stream is None or fan_stream is None:
        return {}
    fan, put = _busy(lanes, fan_stream), _busy(lanes, put_stream)
    both = sum(max(0.0, min(f_end, p_end) - max(f_start, p_start))
               for f_start, f_end in fan for p_start, p_end in put)  # fmt: skip
    return {"fan_ms": sum(e - s for s, e in fan), "put_ms": sum(e - s for s, e in put),
            "fan_beside_put_ms": both}  # fmt: skip


def _lane_labels(streams: list[str], names: dict[str, str]) -> list[str]:
    """Each stream's label: TIDE's name of it (``names``: :func:`_stream_names`), else its
    number."""
    return [f"{names[s]} ({s})" if s in names else f"stream {s}" for s in streams]


def _draw_lanes(ax, lanes: list[dict], streams: list[str], labels: list[str]) -> None:
    colors = {"memcpy": "tab:blue", "other_kernel": "tab:gray", "nccl_kernel": "tab:red"}
    for x in lanes:
        ax.barh(streams.index(str(x["stream"])), x["end_ms"] - x["start_ms"],
                left=x["start_ms"], height=0.6, color=colors[x["kind"]])  # fmt: skip
    ax.set_yticks(range(len(streams)), labels)


def _timeline_png(path: Path, lanes: list[dict], title: str,
                  names: dict[str, str] | None = None, zoom_ms: float = 0.3) -> bool:  # fmt: skip
    """The step's copies and kernels per stream (top) and the first ``zoom_ms`` window with
    copies on the cross-node put and fan-out streams where ``names`` (stream number ->
    TIDE's stream) has them, else on the most streams (bottom); lanes labelled by ``names``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    streams = sorted({str(x["stream"]) for x in lanes})
    labels = _lane_labels(streams, names or {})
    wanted = tuple(s for s in _put_and_fan(names or {}) if s is not None)
    window = _zoom_window(lanes, zoom_ms, wanted)
    panels = 2 if window else 1
    fig, axes = plt.subplots(panels, 1, figsize=(12, panels * (1 + 0.5 * len(streams))),
                             squeeze=False)  # fmt: skip
    _draw_lanes(axes[0][0], lanes, streams, labels)
    axes[0][0].set_xlabel("ms from the step's first device event (copies blue, kernels grey)")
    axes[0][0].set_title(title)
    if window:
        start, end = window
        shown = [x for x in lanes if x["end_ms"] >= start and x["start_ms"] <= end]
        ax = axes[1][0]
        _draw_lanes(ax, shown, streams, labels)
        ax.set_xlim(start - 0.01, end)
        what = "the puts and the fan-out" if wanted else "the most streams"
        ax.set_xlabel(f"ms, zoomed: the first {zoom_ms} ms with copies on {what}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _progress(rank: int, variant: dict, what: str) -> None:
    """Rank 0's progress, flushed: where a variant that ran past its deadline stood."""
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {variant['name']}: {what}", flush=True)


def _worker(rank: int, world: int, args: argparse.Namespace, variant: dict, result: str) -> None:
    from torchtitan_tide import comm

    device = torch.device("cuda", 0)
    nodes, lws = args.nodes, args.local
    model = _build(args, device)
    _progress(rank, variant, "model built and sharded")
    if variant["mode"] == "tide":
        options = {"local_world_size": lws, "cross_node_transport": variant["transport"]}
        if variant["wire"] != "float32":
            options["rs_wire_dtype"] = variant["wire"]
        if "ag_in_place_groups" in variant:
            options["ag_in_place_groups"] = variant["ag_in_place_groups"]
        if args.storage_swap != "native":
            options["ag_storage_swap"] = args.storage_swap
        comm.apply(model, "tide", **options)
        _progress(rank, variant, "TIDE installed")
        host = _time_host_issue(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(1 + rank)

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    for index in range(args.warmup):
        step()
        torch.cuda.synchronize()
        _progress(rank, variant, f"warm-up step {index + 1} done")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    names: dict[str, str] = {}
    if variant["mode"] == "tide" and rank == 0:  # the timeline's lanes named (rank 0's)
        try:
            names = _stream_names(device)
            _progress(rank, variant, f"streams named: {names}")
        except (RuntimeError, OSError, ValueError) as e:  # the lanes keep their numbers, said so
            _progress(rank, variant, f"streams not named ({type(e).__name__}: {e})")
    per_step = []
    for _ in range(args.steps):
        sent = _sent_bytes(model) if variant["mode"] == "tide" else 0
        counts_before = _in_place_counts(model) if variant["mode"] == "tide" else {}
        if variant["mode"] == "tide":
            host.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        _progress(rank, variant, "profiled step done")
        events = _device_events(prof)
        kinds = [common.classify_device_event(e["name"]) for e in events]
        nccl = [e for e, k in zip(events, kinds) if k == "nccl_kernel"]
        copy_bytes = sum((e.get("args") or {}).get("bytes", 0)
                         for e, k in zip(events, kinds) if k == "memcpy")  # fmt: skip
        lanes = _copy_lanes(events)
        per_step.append({
            "nccl_kernels": len(nccl),
            "nccl_kernel_ms": sum(e["dur"] for e in nccl) / 1e3,
            "nccl_sm_ms": sum(common.sm_weighted_us(e["dur"], common.grid_ctas(e), sm_count)
                              for e in nccl) / 1e3,
            "kernels": sum(1 for k in kinds if k.endswith("kernel")),
            "copies": kinds.count("memcpy"),
            "copy_bytes": copy_bytes,
            "wire_bytes": (_sent_bytes(model) - sent if variant["mode"] == "tide"
                           else _fsdp2_wire_bytes(model, world, nodes)),
            "nccl_kernel_names": sorted({e["name"].split("(")[0] for e in nccl}),
            **{key: value - counts_before[key] for key, value in
               (_in_place_counts(model) if variant["mode"] == "tide" else {}).items()},
            **(_host_ms(host) if variant["mode"] == "tide" else {}),
        })  # fmt: skip
    schedule = _last_ag_ops(model) if variant["mode"] == "tide" else []
    if variant["mode"] == "tide":
        comm.remove(model)
        _progress(rank, variant, "TIDE removed")
    if rank == 0:
        row = {"variant": variant["name"], **variant}
        for key in ("nccl_kernels", "nccl_kernel_ms", "nccl_sm_ms", "kernels", "copies",
                    "copy_bytes", "wire_bytes", "host_ms_per_ag", "host_ms_per_rs",
                    "all_gathers", "reduces"):  # fmt: skip
            if key in per_step[0]:
                row[key] = statistics.median(s[key] for s in per_step)
        for key in ("in_place_all_gathers", "placed_copies"):  # per profiled step
            if key in per_step[-1]:
                row[key] = statistics.median(s[key] for s in per_step)
        row["wire_mib"] = row["wire_bytes"] / 2**20
        row["copy_mib"] = row["copy_bytes"] / 2**20
        row["hbm_mib"] = 2 * row["copy_mib"]  # a copy reads and writes HBM (one GPU)
        row["schedule"] = schedule
        if schedule:  # the window transport's step: its copies and kernels, per stream
            row["lanes"] = lanes[:4000]
            row["stream_names"] = names  # stream number (as text) -> TIDE's stream
            row.update(_fan_beside_puts(lanes, names))  # rank 0's copy time, last step
        row["nccl_kernel_names"] = per_step[-1]["nccl_kernel_names"]
        Path(result).write_text(json.dumps(row))


def _layout(text: str) -> tuple[int, int]:
    try:
        nodes, local = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layout {text!r}: NxL, e.g. 2x2") from None
    if nodes < 2 or local < 1:
        raise argparse.ArgumentTypeError(f"--layout {text!r}: at least 2 nodes of 1 rank")
    return nodes, local


def _result_name(emulation: str, nodes: int, local: int) -> str:
    """The results' name: every layout but 2x1 (the simulator's input, ``CROSS_NODE_FILE``
    in ``simulator/inputs.py``) names its shape, so layouts of one call do not overwrite."""
    return f"cross_node_{emulation}" + ("" if (nodes, local) == (2, 1) else f"_{nodes}x{local}")


def _variants(emulation: str, wires: list[str], in_place_compare: bool = False) -> list[dict]:
    out = [{"name": "fsdp2", "mode": "fsdp2", "transport": "-", "wire": "-"}]
    transports = ["p2p"] + (["nccl_one_sided"] if emulation == "one_node" else [])
    for transport in transports:
        for wire in wires:
            short = "one_sided" if transport == "nccl_one_sided" else transport
            out.append({"name": f"tide_{short}_{'bf16' if wire == 'bfloat16' else 'fp32'}_wire",
                        "mode": "tide", "transport": transport, "wire": wire})  # fmt: skip
    if in_place_compare and emulation == "one_node":  # any N x L
        for name, groups in (("in_place", 4), ("placement", 0)):
            out.append({"name": f"tide_one_sided_{name}_fp32_wire", "mode": "tide",
                        "transport": "nccl_one_sided", "wire": "float32",
                        "ag_in_place_groups": groups})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_out_dir(parser)
    parser.add_argument("--emulation", choices=sorted(EMULATION_ENV), default="one_node")
    parser.add_argument("--layout", type=_layout, default=(2, 1),
                        help="N nodes x L ranks on GPU 0 (default 2x1)")  # fmt: skip
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--wires", default="float32,bfloat16",
                        help="TIDE-RS wire dtypes of the tide variants, comma-separated")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant-timeout", type=float, default=300.0,
                        help="seconds per variant; past it its processes are killed, the "
                             "error recorded and the next variant runs")  # fmt: skip
    parser.add_argument("--in-place-compare", action="store_true",
                        help="one_node: add the one-sided fp32 variant with TIDE-AG in place "
                             "(ag_in_place_groups = 4) and without (0)")  # fmt: skip
    parser.add_argument("--storage-swap", choices=("native", "ctypes"), default="native",
                        help="[tide] ag_storage_swap of the tide variants ('ctypes' on a torch "
                             "without UntypedStorage._swap_data_ptr_, e.g. 2.11)")  # fmt: skip
    parser.add_argument(
        "--variants", default="", help="only these variants (comma-separated names); default all"
    )
    args = parser.parse_args()
    args.nodes, args.local = args.layout
    args.ranks = args.nodes * args.local
    args.nccl_env = dict(_shared_gpu_env(args.ranks))  # recorded with the result
    if args.nccl_env:
        print(f"{args.ranks} ranks on one GPU: NCCL {args.nccl_env}", flush=True)
    if args.local > 1 and args.emulation != "one_node":
        parser.error("--layout with L > 1 needs --emulation one_node (ranks share the GPU)")
    if args.in_place_compare and args.emulation != "one_node":
        parser.error("--in-place-compare: TIDE-AG in place runs on the windows: "
                     "--emulation one_node")  # fmt: skip
    from torchtitan_tide.comm.options import TideOptions

    wires = [w for w in args.wires.split(",") if w]
    if not hasattr(TideOptions(), "rs_wire_dtype"):
        wires = ["float32"]
    variants = _variants(args.emulation, wires, args.in_place_compare)
    if args.variants:
        wanted = [w for w in args.variants.split(",") if w]
        unknown = sorted(set(wanted) - {v["name"] for v in variants})
        if unknown:
            parser.error(f"--variants: unknown {unknown}; known: {[v['name'] for v in variants]}")
        variants = [v for v in variants if v["name"] in wanted]
    # one-sided first: the variant the table is for runs while the call has the most time
    order = sorted(variants, key=lambda v: v["transport"] != "nccl_one_sided")
    rows, errors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in order:
            result = os.path.join(tmp, variant["name"] + ".json")
            try:
                harness.spawn(_worker, args.ranks, "cuda:0", (args, variant, result),
                              EMULATION_ENV[args.emulation] + tuple(args.nccl_env.items()),
                              timeout_s=args.variant_timeout)  # fmt: skip
                rows.append(json.loads(Path(result).read_text()))
            except Exception as e:  # noqa: BLE001 - recorded; the next variant runs
                print(f"{variant['name']} failed: {type(e).__name__}: {e}", flush=True)
                errors[variant["name"]] = common.short_error(f"{type(e).__name__}: {e}", 300)
                rows.append({"variant": variant["name"], "error": errors[variant["name"]]})
            print(json.dumps(rows[-1]), flush=True)
    rows.sort(key=lambda row: [v["name"] for v in variants].index(row["variant"]))
    meta = common.metadata(args.ranks)
    shape = f"{args.nodes}x{args.local}"
    name = _result_name(args.emulation, args.nodes, args.local)
    stem = common.result_stem(args.out_dir, name, meta)
    columns = [
        ["variant", "variant"], ["nccl_kernels", "NCCL kernels / step"],
        ["nccl_kernel_ms", "NCCL kernel ms"], ["nccl_sm_ms", "NCCL SM-ms"],
        ["copies", "copies / step"], ["hbm_mib", "copy HBM MiB / rank / step"],
        ["in_place_all_gathers", "AGs in place / step"],
        ["placed_copies", "placement copies / step"],
        ["host_ms_per_ag", "host ms / TIDE-AG"], ["host_ms_per_rs", "host ms / TIDE-RS"],
        ["fan_ms", "fan-out copy ms"], ["fan_beside_put_ms", "of it beside puts ms"],
        ["wire_mib", "cross-node MiB / rank / step"], ["error", "error"],
    ]  # fmt: skip
    args.layout = shape
    results = {
        "kind": "cross_node",
        "metadata": meta,
        "args": vars(args),
        "note": "ranks share one GPU; no step time or bandwidth from here is a cluster figure",
        "tables": [{"title": f"per rank per step, {args.nodes} emulated nodes x {args.local} "
                             f"({args.emulation})", "columns": columns, "rows": rows}],
    }  # fmt: skip
    sided = next((r for r in rows if r.get("schedule")), None)
    notes = ""
    if sided is not None:
        notes = (
            "Ops of one all-gather of a layer as rank 0's window transport ran them "
            f"({sided['variant']}):\n\n```\n" + "\n".join(sided["schedule"]) + "\n```\n"
        )
        if _timeline_png(
            Path(f"{stem}_timeline.png"),
            sided["lanes"],
            f"rank 0, one profiled step, {sided['variant']} ({shape})",
            sided.get("stream_names", {}),
        ):
            notes += (
                f"\nTimeline of that step's copies per stream: `{Path(stem).name}_timeline.png`.\n"
            )
    charts = [
        common.BarChart(title="NCCL SM-ms per step", labels=[r["variant"] for r in rows],
                        values=[r.get("nccl_sm_ms") or 0.0 for r in rows], ylabel="SM-ms"),
        common.BarChart(title="cross-node MiB per rank per step",
                        labels=[r["variant"] for r in rows],
                        values=[r.get("wire_mib") or 0.0 for r in rows], ylabel="MiB"),
    ]  # fmt: skip
    title = f"TIDE multi-node path, {shape} on one GPU (emulated)"
    text = common.write_result(stem, results, title, notes=notes, charts=charts)
    common.announce_results(stem, text)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
