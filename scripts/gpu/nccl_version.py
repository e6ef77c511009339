"""Which NCCL torch runs here: NCCL's own version line, from a 1-rank communicator made with
``NCCL_DEBUG=VERSION``, and the version the loaded library reports (``ncclGetVersion``),
beside what torch was built with (``torch.cuda.nccl.version()``, which does not change when
the library file is swapped: docs/design/2026-12-02-emulation.md).

    python3 scripts/gpu/nccl_version.py

The last line sums it up: ``NCCL 2.30.7 in use (…/libnccl.so.2); torch built with 2.28.9``.
"""

import os
import sys

os.environ["NCCL_DEBUG"] = "VERSION"  # before NCCL is first used: it prints its version line
os.environ.pop("NCCL_DEBUG_FILE", None)

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from torchtitan_tide.comm.transports.windows import nccl_rma


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: NCCL not in use")
        return 1
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=device)
    try:
        x = torch.ones(1, device=device)
        dist.all_reduce(x)  # NCCL prints "NCCL version X" on stdout when the comm starts
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    loaded = nccl_rma.version_text(nccl_rma.nccl_version())
    built = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
    print(f"NCCL {loaded} in use ({nccl_rma.library_path()}); torch built with {built}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
