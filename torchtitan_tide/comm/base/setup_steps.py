"""Install's collective set-up, bounded: a failure on one rank reaches its peers at once.

The copy-engine set-up of a node (``fsdp.install_setup.connect_slots``: the node-local process
group, the symmetric-memory rendezvous, the exchange of every rank's slot details) is
collective over the node's ranks. Run bare, a rank that fails in it leaves its peers
blocked inside it until a store or process-group timeout (minutes). Here every step
runs through :class:`SetupSteps` (one per install, the same sequence on every rank):

- :meth:`SetupSteps.run` runs a blocking collective (``dist.new_group``,
  ``symm_mem.rendezvous``) in a helper thread, on the device the caller names (the one
  place that sets install's set-up device), while the caller watches the default
  store: the step returns its result, or raises this rank's own exception after
  writing it to the store for the peers, or :class:`SetupFailed` as soon as a peer
  wrote one, or :class:`SetupFailed` after ``[tide] install_timeout_s`` without either
  (a peer hung or died; also written for the peers);
- :meth:`SetupSteps.exchange` is an all-gather of small Python values over the store
  (what ``all_gather_object`` did), with the same rules.

The watch and the exchanges use a client of the default store of their own (a TCPStore
client runs one operation at a time, and a blocked rendezvous holds it). A step
abandoned that way keeps its helper thread (a daemon, blocked in the store or
the backend until their own timeout); ``install`` then fails on every rank and frees
what it set up. Store traffic: one key per rank and step, one check of the node's
error key per ``poll_s`` while a step waits.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = ["SetupFailed", "SetupSteps", "default_poll_s"]

T = TypeVar("T")


def _own_client(store: dist.Store) -> dist.Store:
    """A second client of the default store: a step blocked in the store (a
    ``TCPStore`` client serves one operation at a time) must not block the watch."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # noqa: BLE001 - a store without clone: share the client
        return store


_STORE_OPS_PER_S = 2000  # what all waiting ranks together may ask of the one store master


def default_poll_s(world_size: int) -> float:
    """Seconds between a waiting rank's store checks: 50 ms up to 100 ranks, then
    longer, so that the job's ranks together stay near :data:`_STORE_OPS_PER_S` (the
    rendezvous and ``new_group`` barriers use the same store); at most 1 s."""
    return min(1.0, max(0.05, world_size / _STORE_OPS_PER_S))


class SetupFailed(RuntimeError):
    """A peer failed or went silent in a set-up step; the message names it."""


class SetupSteps:
    """The bounded set-up steps of one install (module docstring). ``install``: its
    sequence number, equal on every rank (every rank installs in the same order).
    ``scope`` of a step: a name of its peer set, equal on every peer."""

    def __init__(self, install: int, timeout_s: float, poll_s: float | None = None) -> None:
        self.store = _own_client(dist.distributed_c10d._get_default_store())
        self.prefix = f"tide_install/{install}"
        self.rank = dist.get_rank()
        self.timeout_s = timeout_s
        self.poll_s = default_poll_s(dist.get_world_size()) if poll_s is None else poll_s
        self.abandoned: list[threading.Thread] = []  # helper threads of steps given up

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the helper threads of abandoned steps to end (each
        ends what it made late, ``run``'s ``on_abandoned``); True when all did."""
        deadline = time.monotonic() + timeout_s
        for thread in self.abandoned:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.abandoned = [t for t in self.abandoned if t.is_alive()]
        return not self.abandoned

    def _error_key(self, scope: str) -> str:
        return f"{self.prefix}/{scope}/error"

    def _report(self, scope: str, text: str) -> None:
        self.store.set(self._error_key(scope), text)

    def _peer_error(self, scope: str) -> str | None:
        key = self._error_key(scope)
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def run(
        self,
        step: str,
        scope: str,
        peers: Sequence[int],
        fn: Callable[[], T],
        device: torch.device | None = None,
        on_abandoned: Callable[[T], None] | None = None,
    ) -> T:
        """``fn()`` (a collective over the global ranks ``peers``), bounded (module
        docstring). ``fn`` runs in a helper thread, which starts on CUDA device 0: a CUDA
        ``device`` (this rank's, where the step's buffers and communicators live) is made
        current there first; None or a CPU device sets none. A step this rank abandons
        (a peer's report, the bound) may still return later in its helper thread:
        ``on_abandoned(value)`` then ends what it made (e.g. aborts a communicator).

        Raises:
            SetupFailed: a peer reported a failure, or the step outlived the bound.
            Exception: ``fn``'s own, after reporting it to the peers.
        """
        result: dict[str, object] = {}
        lock = threading.Lock()

        def target() -> None:
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)
                value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                with lock:
                    result["error"] = e
                return
            with lock:
                abandoned = result.get("abandoned", False)
                if not abandoned:
                    result["value"] = value
            if abandoned and on_abandoned is not None:
                on_abandoned(value)

        def abandon() -> None:
            self.abandoned.append(thread)
            with lock:
                result["abandoned"] = True
                value = result.pop("value", None)
            if value is not None and on_abandoned is not None:
                on_abandoned(value)

        thread = threading.Thread(target=target, name=f"tide-setup-{step}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while True:
            thread.join(self.poll_s)
            if not thread.is_alive():
                break
            if (text := self._peer_error(scope)) is not None:
                abandon()
                raise SetupFailed(f"{step} stopped: {text}")
            if time.monotonic() > deadline:
                abandon()
                text = (
                    f"rank {self.rank}: {step} did not complete within [tide] "
                    f"install_timeout_s = {self.timeout_s:g} s (peers {list(peers)}: one hung, "
                    "died or failed without a report)"
                )
                self._report(scope, text)
                raise SetupFailed(text)
        error = result.get("error")
        if isinstance(error, SetupFailed):
            raise error
        if error is not None:
            self._report(scope, f"rank {self.rank} failed in {step}: {type(error).__name__}: {error}")
            raise error  # type: ignore[misc]
        return result["value"]  # type: ignore[return-value]

    def exchange(self, step: str, scope: str, peers: Sequence[int], value: object) -> list:
        """Every peer's ``value``, in the order of ``peers`` (this rank among them).

        Raises:
            SetupFailed: a peer reported a failure, or did not post within the bound.
        """
        keys = [f"{self.prefix}/{scope}/{step}/{peer}" for peer in peers]
        self.store.set(keys[list(peers).index(self.rank)], pickle.dumps(value))
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=self.poll_s))
                break
            except RuntimeError:  # this poll's wait timed out (DistStoreError)
                pass
            if (text := self._peer_error(scope)) is not None:
                raise SetupFailed(f"{step} stopped: {text}") from None
            if time.monotonic() > deadline:
                missing = [p for p, k in zip(peers, keys) if not self.store.check([k])]
                text = (
                    f"rank {self.rank}: {step}: ranks {missing} posted nothing within [tide] "
                    f"install_timeout_s = {self.timeout_s:g} s (hung, died or failed "
                    "without a report)"
                )
                self._report(scope, text)
                raise SetupFailed(text) from None
        return [pickle.loads(self.store.get(k)) for k in keys]
