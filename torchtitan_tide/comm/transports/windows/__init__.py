"""NCCL windows: TIDE's one-sided transport, one concept in one place.

Owns: TIDE-AG and TIDE-RS phase 1 on one registered window per process group
(``transport``), TIDE-RS phase 2 as puts into a ring (``ring``), the one-sided set-up of a
process group, every step agreed and bounded (``connect``), the binding of NCCL's one-sided
calls (``nccl_rma``) and its CPU stand-in (``rma_standin``), and the storage swap of the
in-place all-gather (``storage_swap``). The window's layout, rounds and arena are plans
(``plans/window_rounds.py``, ``plans/window_arena.py``): the simulator and the memory plan
read them without torch.

May import: the rest of ``transports`` (its interface, the copy engine's batch copy),
``plans``, ``base`` and ``options`` of ``comm``; never ``fsdp``
(docs/design/2026-12-07-comm-rooms.md).
"""
