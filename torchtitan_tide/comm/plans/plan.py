"""TIDE-AG layout plan: where every rank's shard of every parameter lands.

Pure Python: dataclasses and integer arithmetic, no ``torch.distributed`` calls,
so every rule here is unit-tested without processes.

Layout facts (FSDP2, dim-0 sharding, torch 2.11-2.13):

- A parameter of an FSDP group is sharded on dim 0 into ``world_size`` chunks;
  chunk 0 is the largest and every rank pads its chunk to that size, so every
  rank holds ``shard_numel`` elements (the *padded* shard, same on all ranks).
- The unsharded storage of the parameter (FSDP's ``all_gather_outputs[0]``)
  is 1-D with ``shard_numel * world_size`` elements, rank-major:
  ``[shard_r0 | shard_r1 | ... ]``. Rank ``r``'s shard lands at
  ``dst_offset(r) = r * shard_numel``. The unsharded parameter is a view of
  the first ``prod(orig_size)`` elements; padding sits in the tail of each
  shard and is written like any other element.
- World = ``num_nodes x local_world_size``, rank ``r = node * L + local``. The
  shards of one node are one contiguous run of a parameter's storage, and so
  are those of any run of consecutive ranks: a set of ranks is moved as one
  :class:`Chunk` per maximal run of consecutive ranks.

Schedule (per rank, deterministic, identical on all ranks):

1. cross-node phase among ranks with the same local index: recursive doubling
   when ``num_nodes`` is a power of two (step ``k`` swaps the aligned block of
   ``2**k`` nodes already held with the partner node ``node ^ 2**k``), else
   ``num_nodes - 1`` direct steps (step ``s`` sends the own shard to node
   ``node + s`` and receives from ``node - s``). After it, rank ``(n, l)``
   holds the shards of ranks ``(m, l)`` for all nodes ``m``.
2. node-local phase: every local peer ``l'`` needs the ``num_nodes`` shards
   ``(m, l)`` this rank holds. As point-to-point steps: step ``s`` sends to
   local index ``l + s`` and receives from ``l - s``. The copy-engine
   transport instead pulls them in one batch (``transports/copy_engine.py``).

When ``local_world_size == 1`` every cross-node step moves ONE contiguous
chunk per parameter (the ``2**k`` node blocks are adjacent). When
``local_world_size > 1`` the shards of one local index are strided by ``L``
shards, so a step moves ``2**k`` chunks of one shard each per parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = [
    "Chunk",
    "Exchange",
    "GroupPlan",
    "PackedEntry",
    "ParamPlan",
    "ParamSpec",
    "RSChunk",
    "RSPlan",
    "RSRound",
    "RSSegment",
    "RSSlice",
    "WorldLayout",
    "build_group_plan",
    "build_rs_plan",
    "chunks_for_ranks",
    "cross_node_exchanges",
    "entry_runs",
    "node_local_exchanges",
    "pace_chunks",
    "packed_entry",
    "rs_cross_node_peers",
    "rs_push_slices",
    "rs_schedule",
    "rs_segments",
]


@dataclass(frozen=True)
class WorldLayout:
    """``num_nodes x local_world_size`` ranks; rank = node * L + local index."""

    world_size: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size={self.local_world_size} must be >= 1 and divide "
                f"world_size={self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def shape(self) -> str:
        """The layout as logs print it: "1 node x 2", "2 nodes x 8"."""
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} x {self.local_world_size}"

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def local_of(self, rank: int) -> int:
        return rank % self.local_world_size

    def rank_of(self, node: int, local: int) -> int:
        return node * self.local_world_size + local

    def node_ranks(self, node: int) -> tuple[int, ...]:
        start = node * self.local_world_size
        return tuple(range(start, start + self.local_world_size))


@dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one FSDP parameter (filled by ``install``).

    ``shard_numel`` is the padded per-rank shard numel. ``dtype`` is the
    all-gather (unsharded) dtype name, e.g. ``"torch.bfloat16"``.
    ``unsupported`` is a reason string when TIDE cannot place the parameter.
    """

    fqn: str
    shard_numel: int
    dtype: str
    unsupported: str | None = None


@dataclass(frozen=True)
class ParamPlan:
    """Placement of one parameter: rank r's shard -> [dst_offset(r), +shard_numel)."""

    index: int
    fqn: str
    shard_numel: int
    world_size: int
    dtype: str

    @property
    def unsharded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def dst_offset(self, rank: int) -> int:
        """Element offset of ``rank``'s shard in the unsharded flat storage."""
        return rank * self.shard_numel


@dataclass(frozen=True)
class Chunk:
    """A contiguous element range ``[offset, offset + numel)`` of one
    parameter's unsharded storage; it holds the shards of ``ranks`` (a run of
    consecutive ranks). Sender and receiver use the same offsets."""

    param_index: int
    offset: int
    numel: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Exchange:
    """One point-to-point step for one rank: send the shards of ``send_ranks``
    to ``send_peer`` and receive the shards of ``recv_ranks`` from
    ``recv_peer`` (peers are group ranks; ``send_peer == recv_peer`` for
    recursive doubling). ``send_waves`` / ``recv_waves``: the messages, the
    :func:`chunks_for_ranks` of ``send_ranks`` / ``recv_ranks`` in waves of at most
    ``pacing`` chunks (:func:`pace_chunks`; filled by :func:`build_group_plan`)."""

    phase: str  # "cross_node" | "node_local"
    step: int
    send_peer: int
    send_ranks: tuple[int, ...]
    recv_peer: int
    recv_ranks: tuple[int, ...]
    send_waves: tuple[tuple[Chunk, ...], ...] = ()
    recv_waves: tuple[tuple[Chunk, ...], ...] = ()


@dataclass(frozen=True)
class GroupPlan:
    """Plan of one FSDP parameter group as seen from ``rank``.

    ``fallback_reason`` is set when the group must take FSDP2's own path;
    then ``params``/``exchanges`` are empty.
    """

    rank: int
    layout: WorldLayout
    params: tuple[ParamPlan, ...] = ()
    exchanges: tuple[Exchange, ...] = ()
    fallback_reason: str | None = None
    dtypes: tuple[str, ...] = field(default=())

    @property
    def uses_tide(self) -> bool:
        return self.fallback_reason is None


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def cross_node_exchanges(layout: WorldLayout, rank: int) -> list[Exchange]:
    """Cross-node steps of ``rank`` (empty for one node). See module docstring."""
    num_nodes, local = layout.num_nodes, layout.local_of(rank)
    node = layout.node_of(rank)
    out: list[Exchange] = []
    if num_nodes == 1:
        return out
    if _is_power_of_two(num_nodes):
        k, block = 0, 1
        while block < num_nodes:
            partner = node ^ block
            my_start = (node // block) * block
            peer_start = (partner // block) * block
            out.append(
                Exchange(
                    phase="cross_node",
                    step=k,
                    send_peer=layout.rank_of(partner, local),
                    send_ranks=tuple(
                        layout.rank_of(m, local) for m in range(my_start, my_start + block)
                    ),
                    recv_peer=layout.rank_of(partner, local),
                    recv_ranks=tuple(
                        layout.rank_of(m, local) for m in range(peer_start, peer_start + block)
                    ),
                )
            )
            k, block = k + 1, block * 2
        return out
    for s in range(1, num_nodes):
        dst_node, src_node = (node + s) % num_nodes, (node - s) % num_nodes
        out.append(
            Exchange(
                phase="cross_node",
                step=s - 1,
                send_peer=layout.rank_of(dst_node, local),
                send_ranks=(rank,),
                recv_peer=layout.rank_of(src_node, local),
                recv_ranks=(layout.rank_of(src_node, local),),
            )
        )
    return out


def node_local_exchanges(layout: WorldLayout, rank: int) -> list[Exchange]:
    """Node-local point-to-point steps of ``rank`` (run after the cross-node
    phase): step ``s`` sends the shards ``(m, l)`` for all nodes ``m`` to local
    index ``l + s`` and receives ``(m, l - s)`` from local index ``l - s``."""
    L, node, local = layout.local_world_size, layout.node_of(rank), layout.local_of(rank)
    out: list[Exchange] = []
    for s in range(1, L):
        dst_local, src_local = (local + s) % L, (local - s) % L
        out.append(
            Exchange(
                phase="node_local",
                step=s - 1,
                send_peer=layout.rank_of(node, dst_local),
                send_ranks=tuple(layout.rank_of(m, local) for m in range(layout.num_nodes)),
                recv_peer=layout.rank_of(node, src_local),
                recv_ranks=tuple(layout.rank_of(m, src_local) for m in range(layout.num_nodes)),
            )
        )
    return out


def chunks_for_ranks(params: tuple[ParamPlan, ...], ranks: tuple[int, ...]) -> list[Chunk]:
    """The contiguous chunks holding the shards of ``ranks``, per parameter, in
    parameter order then rank order. Consecutive ranks merge into one chunk."""
    runs: list[tuple[int, ...]] = []
    for r in sorted(ranks):
        if runs and runs[-1][-1] + 1 == r:
            runs[-1] = runs[-1] + (r,)
        else:
            runs.append((r,))
    chunks: list[Chunk] = []
    for p in params:
        if p.shard_numel == 0:
            continue
        for run in runs:
            chunks.append(
                Chunk(
                    param_index=p.index,
                    offset=p.dst_offset(run[0]),
                    numel=p.shard_numel * len(run),
                    ranks=run,
                )
            )
    return chunks


def pace_chunks(chunks: list[Chunk], pacing: int) -> list[tuple[Chunk, ...]]:
    """Split one step's chunks into waves of at most ``pacing`` chunks
    (``pacing <= 0``: one wave). Both sides of an exchange compute the same
    waves from the same plan, so wave ``i`` of the sender matches wave ``i`` of
    the receiver."""
    if pacing <= 0 or len(chunks) <= pacing:
        return [tuple(chunks)] if chunks else []
    return [tuple(chunks[i : i + pacing]) for i in range(0, len(chunks), pacing)]


def build_group_plan(
    specs: list[ParamSpec],
    layout: WorldLayout,
    rank: int,
    *,
    pull_local: bool = False,
    pacing: int = 0,
) -> GroupPlan:
    """Plan one FSDP group for ``rank``.

    Any unsupported parameter makes the whole group fall back (FSDP2 gathers a
    group in one collective; splitting a group between two paths would need two
    results per unshard). ``pull_local=True`` leaves the node-local phase to a
    pull-based transport (no node-local exchanges in the plan). Every exchange
    carries its messages in waves of at most ``pacing`` chunks (``[tide]
    ag_pacing``; 0: one wave), so the transport only posts them.
    """
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside world of {layout.world_size}")
    bad = [f"{s.fqn}: {s.unsupported}" for s in specs if s.unsupported]
    if bad:
        return GroupPlan(rank=rank, layout=layout, fallback_reason="; ".join(bad))
    if not specs:
        return GroupPlan(rank=rank, layout=layout, fallback_reason="no parameters")
    params = tuple(
        ParamPlan(
            index=i,
            fqn=s.fqn,
            shard_numel=s.shard_numel,
            world_size=layout.world_size,
            dtype=s.dtype,
        )
        for i, s in enumerate(specs)
    )
    exchanges = cross_node_exchanges(layout, rank)
    if not pull_local:
        exchanges += node_local_exchanges(layout, rank)
    exchanges = [
        dataclasses.replace(
            ex,
            send_waves=tuple(pace_chunks(chunks_for_ranks(params, ex.send_ranks), pacing)),
            recv_waves=tuple(pace_chunks(chunks_for_ranks(params, ex.recv_ranks), pacing)),
        )
        for ex in exchanges
    ]
    return GroupPlan(
        rank=rank,
        layout=layout,
        params=params,
        exchanges=tuple(exchanges),
        dtypes=tuple(sorted({s.dtype for s in specs})),
    )


@dataclass(frozen=True)
class PackedEntry:
    """One rank's shards of a group packed in a staging entry (copy-engine slot,
    one-sided window): parameter ``i``'s ``nbytes[i]`` bytes at ``offsets[i]``, each
    16-byte aligned; ``entry_bytes`` per rank, entry ``m`` (node ``m``'s rank) at
    ``m * entry_bytes`` of a round's half."""

    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]
    entry_bytes: int


def packed_entry(params: tuple[ParamPlan, ...], itemsizes: list[int]) -> PackedEntry:
    """The packed entry of ``params`` in the all-gather dtypes' ``itemsizes``."""
    nbytes = tuple(p.shard_numel * size for p, size in zip(params, itemsizes))
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += (n + 15) // 16 * 16
    return PackedEntry(nbytes, tuple(offsets), total)


def entry_runs(nodes: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive node indices as ``(first, count)``."""
    out: list[tuple[int, int]] = []
    for m in sorted(nodes):
        if out and out[-1][0] + out[-1][1] == m:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


# ---------------------------------------------------------------- TIDE-RS
#
# Gradient layout (FSDP2, dim-0 sharding): parameter p's unsharded gradient is
# flat with ``numel`` elements; rank r owns elements [r * s_p, (r + 1) * s_p)
# (``s_p`` = padded shard numel), of which ``valid(r)`` exist (the rest is
# dim-0 padding, zero in FSDP's own reduce-scatter input). Rank r's reduced
# shard of a group is ONE flat fp32 tensor of ``sum_p s_p`` elements, param p
# at ``out_offset`` (FSDP's reduce output layout, so FSDP's per-parameter
# views stay valid). A staging row (one source's slices for one destination)
# uses the same offsets.
#
# Schedule of one rank (n, l) in a world of N nodes x L (``rs_schedule``):
# chunk m (m = n first, then n+1, n+2, ... mod N) reduces, within node n, the
# slices destined to ranks (m, l') for every local l'. It runs in windows of
# ``rows`` source offsets t: in window j rank (n, l) pushes its slice for
# (m, l + t) to local peer l + t (row t - j * rows) and receives into its own
# row t - j * rows the slice of local peer l - t for (m, l). Chunk n is summed
# straight into the output; every other chunk into an fp32 partial that the
# cross-node phase sends to rank (m, l) (``rs_cross_node_peers``).


@dataclass(frozen=True)
class RSSegment:
    """One parameter's part of a reduce-scatter: its gradient has ``numel``
    elements, its padded shard ``shard_numel``, its place in the flat shard
    (and in every staging row) starts at ``out_offset``."""

    param_index: int
    numel: int
    shard_numel: int
    out_offset: int

    def src_offset(self, dst_rank: int) -> int:
        """Element offset of ``dst_rank``'s slice in the flat unsharded gradient."""
        return dst_rank * self.shard_numel

    def valid(self, dst_rank: int) -> int:
        """Elements of ``dst_rank``'s slice that exist (the rest is padding)."""
        return max(0, min(self.shard_numel, self.numel - dst_rank * self.shard_numel))


def rs_segments(numels: list[int], shard_numels: list[int]) -> tuple[tuple[RSSegment, ...], int]:
    """Segments of the parameters of one reduce-scatter call and the flat shard
    numel (sum of padded shard numels)."""
    if len(numels) != len(shard_numels):
        raise ValueError(f"{len(numels)} gradients but {len(shard_numels)} shard sizes")
    segments, offset = [], 0
    for i, (numel, shard) in enumerate(zip(numels, shard_numels)):
        segments.append(RSSegment(i, numel, shard, offset))
        offset += shard
    return tuple(segments), offset


@dataclass(frozen=True)
class RSRound:
    """One node-local round of rank (n, l) for chunk ``chunk_node`` = m.

    ``sends``: (local peer l', row): push the slice for rank (m, l') into row
    ``row`` of l''s staging. ``recvs``: (local peer l', row): row ``row`` of
    this rank's staging receives l''s slice for rank (m, l). ``first`` /
    ``last``: first / last window of the chunk."""

    chunk_node: int
    window: int
    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]
    first: bool
    last: bool


def rs_schedule(layout: WorldLayout, rank: int, rows: int) -> list[RSRound]:
    """All node-local rounds of ``rank``, in order (see the section comment)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    num_nodes, lws = layout.num_nodes, layout.local_world_size
    node, local = layout.node_of(rank), layout.local_of(rank)
    rows = min(rows, lws)
    windows = -(-lws // rows)
    out: list[RSRound] = []
    for step in range(num_nodes):
        chunk = (node + step) % num_nodes
        for j in range(windows):
            offsets = range(j * rows, min(lws, (j + 1) * rows))
            out.append(
                RSRound(
                    chunk_node=chunk,
                    window=j,
                    sends=tuple(((local + t) % lws, t - j * rows) for t in offsets),
                    recvs=tuple(((local - t) % lws, t - j * rows) for t in offsets),
                    first=j == 0,
                    last=j == windows - 1,
                )
            )
    return out


@dataclass(frozen=True)
class RSSlice:
    """One non-empty slice a rank pushes in a round: ``numel`` elements of its flat
    gradient ``param_index`` from ``src_offset``, into row ``row`` of local peer
    ``peer``'s staging at element ``dst_offset``."""

    peer: int
    row: int
    param_index: int
    src_offset: int
    dst_offset: int
    numel: int


def rs_push_slices(
    layout: WorldLayout, rnd: RSRound, segments: tuple[RSSegment, ...]
) -> list[RSSlice]:
    """The slices a rank pushes in round ``rnd`` (every transport moves these)."""
    out: list[RSSlice] = []
    for peer, row in rnd.sends:
        dst_rank = layout.rank_of(rnd.chunk_node, peer)
        for seg in segments:
            if (valid := seg.valid(dst_rank)) > 0:
                out.append(
                    RSSlice(
                        peer, row, seg.param_index, seg.src_offset(dst_rank), seg.out_offset, valid
                    )
                )
    return out


def rs_cross_node_peers(layout: WorldLayout, rank: int, chunk_node: int) -> tuple[int, int]:
    """Cross-node step for chunk ``chunk_node`` = (n + s) mod N, s > 0: send the
    partial to rank (chunk_node, l), receive rank (n - s, l)'s partial for this
    rank. Returns (send_peer, recv_peer) as group ranks."""
    num_nodes = layout.num_nodes
    node, local = layout.node_of(rank), layout.local_of(rank)
    step = (chunk_node - node) % num_nodes
    if step == 0:
        raise ValueError("the own node's chunk has no cross-node step")
    return layout.rank_of(chunk_node, local), layout.rank_of((node - step) % num_nodes, local)


@dataclass(frozen=True)
class RSChunk:
    """One chunk of a TIDE-RS reduce as one rank runs it: the ranks of node
    ``chunk_node`` own it; its node-local ``rounds`` (:func:`rs_schedule`) with the
    slices this rank pushes in each (``pushes[i]``: :func:`rs_push_slices` of
    ``rounds[i]``); for another node's chunk the cross-node ``(send_peer,
    recv_peer)`` (:func:`rs_cross_node_peers`; None for the own node's chunk)."""

    chunk_node: int
    rounds: tuple[RSRound, ...]
    pushes: tuple[tuple[RSSlice, ...], ...]
    cross_peers: tuple[int, int] | None


@dataclass(frozen=True)
class RSPlan:
    """A TIDE-RS reduce of one gradient shape as ``rank`` runs it, every message
    decided: the gradients' ``segments``, the flat fp32 ``shard_numel``, and the
    ``chunks`` in the order the rank reduces them."""

    segments: tuple[RSSegment, ...]
    shard_numel: int
    chunks: tuple[RSChunk, ...]


def build_rs_plan(
    layout: WorldLayout, rank: int, rows: int, numels: list[int], shard_numels: list[int]
) -> RSPlan:
    """The :class:`RSPlan` of ``rank`` for gradients of ``numels`` elements (padded
    shards ``shard_numels``) with ``rows`` source rows per round (pure: the caller
    caches it per shape)."""
    segments, shard_numel = rs_segments(numels, shard_numels)
    by_node: dict[int, list[RSRound]] = {}
    for rnd in rs_schedule(layout, rank, rows):
        by_node.setdefault(rnd.chunk_node, []).append(rnd)
    node = layout.node_of(rank)
    chunks = tuple(
        RSChunk(
            chunk_node=m,
            rounds=tuple(rounds),
            pushes=tuple(tuple(rs_push_slices(layout, rnd, segments)) for rnd in rounds),
            cross_peers=None if m == node else rs_cross_node_peers(layout, rank, m),
        )
        for m, rounds in by_node.items()
    )
    return RSPlan(segments, shard_numel, chunks)
