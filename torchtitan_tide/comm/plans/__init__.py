"""The plans: where every byte goes and in which order, as data the code runs.

Owns: the layout plan of an FSDP group (``plan``: where rank r's shard of parameter p lands,
the exchanges, TIDE-RS's rounds), the window's byte layout and its rounds as op lists
(``window_rounds``), the in-place arena's ranges (``window_arena``), the buffer bytes of every
comm mode (``memory_plan``), the group sizes a node must divide (``group_sizes``) and the
ranks' topology and transport choice (``topology``). Pure Python but ``topology``, which
reads the ranks' devices and makes node-local groups: the simulator and the memory report
import these modules without torch.

May import: ``options`` of ``comm``. Imports nothing else of ``comm``
(docs/design/2026-12-07-comm-rooms.md).
"""
