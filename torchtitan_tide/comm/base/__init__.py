"""The ground floor of ``comm``: device primitives and the guards every layer uses.

Owns: the CUDA side streams (``streams``), TIDE-RS's accumulate kernel (``kernels``), the
global ranks of a process group (``ranks``); the guards: every wait on a peer bounded and
reported (``watchdog``), install's collective steps bounded (``setup_steps``), and the
poison test hook (``poison``).

May import: nothing of ``comm`` (docs/design/2026-12-07-comm-rooms.md).
"""
