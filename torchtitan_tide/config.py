"""The ``[tide]`` TOML section: which FSDP communication path a run takes.

TorchTitan merges this module's ``JobConfig`` into its own when a TOML file sets
``[job] custom_config_module = "torchtitan_tide.config"``. Every option is a
field of :class:`Tide`; values are checked in ``Tide.__post_init__`` and unknown
keys by :func:`validate_tide_table`, so a bad TOML fails before any process
group exists, with an error that names the key and the fix. The TIDE-AG/RS options
are those of ``comm.options.TideOptions`` (the source: defaults and validation), under
their TOML names (``comm.options.TOML_KEYS``); :meth:`Tide.tide_options` derives one.
"""

from dataclasses import dataclass, field, fields
from typing import Any

from models.wan22.job_config import Wan22DataConfig
from torchtitan_tide.comm.options import TideOptionError, TideOptions, toml_key

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

COMM_MODES = ("fsdp2", "symm_mem", "tide")
FALLBACKS = ("none", "fsdp2")
NONFINITE = ("stop", "skip")
CORRUPT_CHECKPOINT = ("stop", "previous")
# Options read only when comm = "tide": TideOptions' fields, by their [tide] keys.
TIDE_ONLY_KEYS = tuple(toml_key(f.name) for f in fields(TideOptions))
_OPTION_OF_KEY = {toml_key(f.name): f.name for f in fields(TideOptions)}
_DEFAULT = TideOptions()


class TideConfigError(ValueError):
    """A ``[tide]`` option has a bad name or value; the message says which and how to fix it."""


@dataclass
class Tide:
    comm: str = "fsdp2"
    """FSDP2 communication mode.
    "fsdp2": stock FSDP2 (flat rank-major buffers, NCCL kernels, copy-in/copy-out).
    "symm_mem": FSDP2 with its collective buffers in symmetric memory (GPU, NCCL only).
    "tide": layout-aware zero-copy collectives (TIDE-AG all-gather and, unless
    reduce_scatter = "fsdp2", TIDE-RS reduce-scatter)."""

    fallback: str = "none"
    """What to do when `comm` cannot run on this hardware (e.g. "symm_mem" on CPU/gloo).
    "none": fail with an error that says why. "fsdp2": run stock FSDP2 instead and log the
    fallback on every rank."""

    ag_transport: str = _DEFAULT.transport
    """TIDE-AG transport (also TIDE-RS's node-local rounds). "auto", per FSDP group and
    logged: NCCL windows (one-sided puts, copy engine in the node) across nodes and where
    ranks share a GPU or lack CUDA P2P, if the loaded NCCL (>= 2.29) has host RMA; the copy
    engine on one node of GPUs with P2P; point-to-point send/recv otherwise (gloo on CPU).
    "nccl_windows" | "copy_engine" | "nccl_p2p" | "gloo" force one (a named error where it
    cannot run). Only read when comm = "tide"."""

    local_world_size: int = 0
    """Ranks per node as TIDE sees them. 0: detect (each rank's kernel boot id and launcher
    node rank; host names alone merge containers). Set it
    to test the cross-node path on one host, e.g. 1 to treat 2 GPUs as 2 nodes. Must divide
    every FSDP group TorchTitan builds: dp_shard x cp, and with expert parallelism the
    experts' dp_shard x cp x tp / (ep x etp) (checked by the launcher). Only read when
    comm = "tide"."""

    ag_pacing: int = _DEFAULT.pacing
    """TIDE-AG cross-node pacing: the most point-to-point chunks in flight per
    recursive-doubling step (on NCCL windows: entries put per wave). 0: no limit. Only read
    when comm = "tide"."""

    cross_node_transport: str = _DEFAULT.cross_node_transport
    """What moves TIDE's cross-node traffic (TIDE-AG across nodes, TIDE-RS phase 2).
    "auto": NCCL's one-sided puts (no send/recv kernel: copy engine in reach of NVLink,
    NCCL's RMA proxy over IB/RoCE) where the loaded NCCL is >= 2.29 and reports host RMA
    between the group's ranks, else point-to-point send/recv (the reason is logged).
    "p2p": always send/recv. "nccl_one_sided": one-sided or a named error.
    Only read when comm = "tide"."""

    reduce_scatter: str = _DEFAULT.reduce_scatter
    """Reduce-scatter under comm = "tide". "tide": TIDE-RS (bf16 gradients read in place,
    fp32 accumulation by a few-CTA kernel, cross-node phase over point-to-point).
    "fsdp2": keep FSDP2's reduce-scatter (TIDE-AG only)."""

    rs_ctas: int = _DEFAULT.rs_ctas
    """CTAs of the TIDE-RS accumulate kernel. 0 (default): short-lived CTAs, one per 16K
    elements, scheduled on free SMs at the compute stream's priority (measured best on
    2x H200: fastest step, +11% on a GEMM beside it). N > 0: N persistent CTAs (never more
    than N SMs, ~50 GB/s each on H200, so a long kernel that GEMM CTAs wait behind)."""

    rs_rows: int = _DEFAULT.rs_rows
    """TIDE-RS source rows per staging slot (node-local peers summed per kernel pass);
    the staging buffer is rs_rows x the largest FSDP group's shard, whatever the GPU count."""

    rs_inflight: int = _DEFAULT.rs_inflight
    """TIDE-RS cross-node phase: fp32 partials allowed to wait for the network at once."""

    rs_wire_dtype: str = _DEFAULT.rs_wire_dtype
    """TIDE-RS cross-node phase: dtype of the partials on the wire. "float32" (default):
    exact fp32 partials. "bfloat16": each node's fp32 partial is rounded once to bf16 before
    it is sent (half the cross-node bytes), the owner accumulates in fp32; costs one bf16
    rounding (relative 2^-8) per other node's partial, also with fp32 gradients (measured
    in docs/design/2026-12-02-rs-wire.md). No effect on one node."""

    slot_reuse: bool = _DEFAULT.slot_reuse
    """Copy engine and NCCL windows: TIDE-RS stages gradients in TIDE-AG's slots instead
    of a buffer of its own."""

    slot_barrier: str = _DEFAULT.slot_barrier
    """Copy engine: how local peers synchronize on the slots. "copy_engine": stream
    flag writes and waits, no SM kernel. "kernel": torch's symmetric-memory barrier
    kernel (1 CTA spinning on an SM while it waits)."""

    ag_in_place_groups: int = _DEFAULT.ag_in_place_groups
    """NCCL windows across nodes (any N x L): TIDE-AG delivers straight into the parameters'
    unsharded storage, which lives in the window's arena until the reshard; the arena holds
    this many of the largest FSDP groups at once (4 covers root, last block, two in
    flight). An all-gather that finds it full places with copies (logged). 0: always copy
    (docs/design/2026-12-04-windows.md)."""

    ag_storage_swap: str = _DEFAULT.ag_storage_swap
    """How TIDE-AG in place points a parameter's storage at the window's arena. "native"
    (default): torch's UntypedStorage._swap_data_ptr_ (torch >= 2.12); a torch without it
    (2.11) places every all-gather with copies, the reason logged. "ctypes": on such a
    torch, exchange the storages' fields with ctypes (probed and trial-checked at start-up,
    checked at every swap; docs/design/2026-12-07-in-place-robust.md)."""

    install_timeout_s: int = _DEFAULT.install_timeout_s
    """Seconds each step of TIDE's collective set-up at install (node-local process
    groups, symmetric-memory rendezvous, exchange of slot details) waits for the other
    ranks of its node. A rank that fails in a step tells its peers at once; past the bound
    a silent peer (hung or dead) fails the step on every rank waiting for it, naming it.
    Only read when comm = "tide"."""

    metrics_jsonl: bool = True
    """Write every logged step's metrics (loss, grad norm, memory, timings) to
    `<dump_folder>/metrics.jsonl` on the metrics rank, at full float precision, so runs in
    different comm modes can be compared step by step."""

    watchdog_timeout_s: int = 0
    """Deadline (whole seconds, as TorchTitan's comm timeouts) of every TIDE wait on a
    peer (copy-engine slot barrier, all-gather run-ahead bound, point-to-point phases);
    past it the rank logs the operation, step and peers, aborts its process groups and
    exits non-zero.
    0: TorchTitan's comm.train_timeout_seconds (at least comm.init_timeout_seconds in the
    first step of each process: step 1, or the first step after a resume)."""

    nonfinite: str = "stop"
    """A NaN/inf loss or gradient norm. "stop": end the run with an error naming the
    step and the value (the step is never checkpointed). "skip": drop that step's
    gradients (no optimizer update; the learning-rate schedule still advances), log it
    and go on."""

    max_skipped_steps: int = 10
    """Under nonfinite = "skip": the run stops (as with "stop") once this many steps in a
    row were not finite. A skipped step is never checkpointed. Must be >= 1."""

    corrupt_checkpoint: str = "stop"
    """A checkpoint whose files do not match the sha256 manifest written after its save.
    "stop": fail, naming the file and the previous good step. "previous": move the bad
    step folder to <checkpoint folder>/corrupt/ (nothing is deleted), log it and resume
    from the previous good step."""

    def __post_init__(self) -> None:
        _check_choice("comm", self.comm, COMM_MODES)
        _check_choice("fallback", self.fallback, FALLBACKS)
        _check_choice("nonfinite", self.nonfinite, NONFINITE)
        _check_int("max_skipped_steps", self.max_skipped_steps, minimum=1)
        _check_choice("corrupt_checkpoint", self.corrupt_checkpoint, CORRUPT_CHECKPOINT)
        _check_int("watchdog_timeout_s", self.watchdog_timeout_s, minimum=0)
        if not isinstance(self.metrics_jsonl, bool):
            raise TideConfigError(
                f"[tide] metrics_jsonl = {self.metrics_jsonl!r} is not a boolean; "
                "write metrics_jsonl = true or false"
            )
        self.tide_options()  # the TIDE-AG/RS options: TideOptions' validation

    def tide_options(self) -> TideOptions:
        """The TIDE-AG/RS options of this section (validated by ``TideOptions``).

        Raises:
            TideConfigError: naming the bad ``[tide]`` key and the fix.
        """
        try:
            return TideOptions(**{name: getattr(self, key) for key, name in _OPTION_OF_KEY.items()})
        except TideOptionError as exc:
            raise TideConfigError(str(exc)) from None

    def comm_options(self) -> dict[str, Any]:
        """Keyword options for ``torchtitan_tide.comm.apply``; empty unless comm = "tide"."""
        if self.comm != "tide":
            return {}
        options = self.tide_options()
        return {f.name: getattr(options, f.name) for f in fields(options)}

    def options_ignored_by_mode(self) -> list[str]:
        """Names of TIDE-only options set away from their defaults while comm != "tide"."""
        if self.comm == "tide":
            return []
        defaults = Tide()
        return [
            name
            for name in TIDE_ONLY_KEYS
            if getattr(self, name) != getattr(defaults, name)
        ]


@dataclass
class JobConfig:
    """Merged into TorchTitan's JobConfig through ``[job] custom_config_module``:
    ``[tide]`` for every run, ``[wan22]`` for the Wan2.2 spec (ignored by others)."""

    tide: Tide = field(default_factory=Tide)
    wan22: Wan22DataConfig = field(default_factory=Wan22DataConfig)


def validate_tide_table(table: dict[str, Any] | None) -> Tide:
    """Check a raw ``[tide]`` TOML table (unknown keys and values) and build :class:`Tide`.

    Raises:
        TideConfigError: naming the bad key or value and listing what is accepted.
    """
    table = dict(table or {})
    known = [f.name for f in fields(Tide)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise TideConfigError(
            f"[tide] has unknown key(s) {unknown}; valid keys are {known}. "
            "Remove or rename them (see torchtitan_tide/config.py)."
        )
    return Tide(**table)


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TideConfigError(
            f"[tide] {key} = {value!r} is not valid; choose one of {list(choices)}"
        )


def _check_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TideConfigError(
            f"[tide] {key} = {value!r} must be an integer >= {minimum}"
        )


def load_toml(path: str) -> dict[str, Any]:
    """Parse a TOML file; errors name the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise TideConfigError(f"config file {path!r} is not valid TOML: {exc}") from None


def check_config_file(path: str) -> Tide:
    """Validate the ``[tide]`` table and the custom_config_module of a training TOML."""
    return check_config_table(load_toml(path), path)


def check_config_table(table: dict[str, Any], path: str) -> Tide:
    """:func:`check_config_file` for an already parsed TOML ``table`` read from ``path``."""
    if "tide" in table:
        custom_module = table.get("job", {}).get("custom_config_module")
        if custom_module != "torchtitan_tide.config":
            raise TideConfigError(
                f"{path}: has a [tide] section but [job] custom_config_module = "
                f"{custom_module!r}; set it to \"torchtitan_tide.config\""
            )
    try:
        return validate_tide_table(table.get("tide"))
    except TideConfigError as exc:
        raise TideConfigError(f"{path}: {exc}") from None
