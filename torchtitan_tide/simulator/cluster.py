"""The simulated cluster: node shape, NIC bandwidth and the NCCL generation installed
(``train_configs/clusters/*.toml``, table ``[cluster]``).

The NCCL generation decides what ``symm_mem`` (FSDP2 + NCCL symmetric memory + zero-CTA
policy) runs, from NCCL's release notes (docs/design/2026-12-02-simulator.md quotes them):

- 2.28.9 (measured on the 2x H200): node-local zero-CTA all-gather on the copy engine;
  reduce-scatter by NCCL's symmetric kernel (``ReduceScatter_LD``), slower than the ring
  kernel at 2 ranks; across nodes both are NCCL's flat algorithms.
- >= 2.29.7: hybrid LSA + GIN symmetric reduce-scatter kernels (hierarchical: node-local
  over NVLink, then GPU-initiated networking).
- >= 2.30.7: hierarchical zero-SM all-gather (copy engines inside the node, the RMA CPU
  proxy across nodes) and "optimized ReduceScatter symmetric kernel performance".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchtitan_tide.config import tomllib

GIB = 2**30
NCCL_MEASURED = "2.28.9"  # the NCCL of every committed 2x H200 measurement
HIERARCHICAL_AG = (2, 30, 7)  # zero-SM hierarchical all-gather (RMA proxy + copy engines)
HIERARCHICAL_RS = (2, 30, 7)  # LSA+GIN symmetric RS (2.29.7), optimized kernel (2.30.7)


class ClusterError(ValueError):
    """A bad cluster file; the message names the file, the key and the fix."""


def nccl_tuple(version: str) -> tuple[int, int, int]:
    """``"2.30.7"`` -> ``(2, 30, 7)``; missing parts are 0."""
    try:
        parts = [int(p) for p in str(version).split(".")]
    except ValueError:
        raise ClusterError(f"nccl_version {version!r}: write it as MAJOR.MINOR.PATCH") from None
    if not 1 <= len(parts) <= 3:
        raise ClusterError(f"nccl_version {version!r}: write it as MAJOR.MINOR.PATCH")
    return tuple((parts + [0, 0])[:3])  # type: ignore[return-value]


@dataclass(frozen=True)
class Cluster:
    """A cluster file's ``[cluster]`` table (TOML)."""

    name: str = f"default: 8 GPUs per node, 400 Gb/s NIC per GPU, NCCL {NCCL_MEASURED}"
    gpus_per_node: int = 8
    """GPUs of one node (NVLink domain)."""
    nic_gbps_per_gpu: float = 400.0
    """Network bandwidth per GPU, Gbit/s (one NIC per GPU: 400 for 8x400G)."""
    nccl_version: str = NCCL_MEASURED
    """The installed NCCL; decides symm_mem's algorithms (module docstring)."""
    source: str = "default"

    @property
    def net_gibps(self) -> float:
        return self.nic_gbps_per_gpu * 1e9 / 8 / GIB

    @property
    def hierarchical_ag(self) -> bool:
        """symm_mem's all-gather is NCCL's hierarchical zero-SM one (NCCL >= 2.30.7)."""
        return nccl_tuple(self.nccl_version) >= HIERARCHICAL_AG

    @property
    def hierarchical_rs(self) -> bool:
        """symm_mem's reduce-scatter is NCCL's optimized LSA+GIN symmetric kernel."""
        return nccl_tuple(self.nccl_version) >= HIERARCHICAL_RS


KNOWN_KEYS = ("name", "gpus_per_node", "nic_gbps_per_gpu", "nccl_version")


def load_cluster(path: str | Path | None) -> Cluster:
    """The cluster of ``path`` (TOML, table ``[cluster]``); the default without one."""
    if path is None:
        return Cluster()
    try:
        table = tomllib.loads(Path(path).read_text()).get("cluster")
    except FileNotFoundError:
        raise ClusterError(f"--cluster {path}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"--cluster {path}: not TOML ({exc})") from None
    if not isinstance(table, dict):
        raise ClusterError(f"--cluster {path}: needs a [cluster] table")
    if "nccl_hierarchical_ag" in table:
        raise ClusterError(
            f"--cluster {path}: [cluster] nccl_hierarchical_ag is replaced by nccl_version "
            '(e.g. nccl_version = "2.30.7" for the hierarchical all-gather)'
        )
    if unknown := sorted(set(table) - set(KNOWN_KEYS)):
        raise ClusterError(f"--cluster {path}: unknown key(s) {unknown}; known: {list(KNOWN_KEYS)}")
    for key in ("gpus_per_node", "nic_gbps_per_gpu"):
        value = table.get(key, getattr(Cluster, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ClusterError(f"--cluster {path}: [cluster] {key} = {value!r} must be > 0")
    version = str(table.get("nccl_version", NCCL_MEASURED))
    try:
        nccl_tuple(version)
    except ClusterError as exc:
        raise ClusterError(f"--cluster {path}: [cluster] {exc}") from None
    return Cluster(
        name=str(table.get("name", Path(path).stem)),
        gpus_per_node=int(table.get("gpus_per_node", 8)),
        nic_gbps_per_gpu=float(table.get("nic_gbps_per_gpu", 400.0)),
        nccl_version=version,
        source=f"file: {path}",
    )
