"""The FSDP2 seam: where TIDE meets FSDP2, and the only package that reads FSDP2's internals.

Owns: the reads of FSDP2's private state, version differences included (``internals``);
the patch of FSDP2's three collective functions and two methods that sends TIDE's groups to
TIDE (``patch``); TIDE-AG and TIDE-RS as FSDP2 calls them, with their streams and results
(``all_gather``, ``reduce_scatter``); ``install``, which decides per FSDP group
(``install_groups``), sets up the windows and slots (``install_setup``) and marks the groups.

May import: ``transports``, ``plans``, ``base`` and ``options`` of ``comm``. Nothing below
imports it (docs/design/2026-12-07-comm-rooms.md).
"""
