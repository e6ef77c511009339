"""Report what this GPU machine offers TIDE: versions, copy-engine batch API, symmetric
memory, and the FSDP2 internals TIDE patches. Prints one JSON object.

Usage: python scripts/gpu/probe.py
"""

import importlib
import inspect
import json

import torch


def probe() -> dict:
    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.device_count() > 1:
            report["p2p_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    try:
        from cuda.bindings import runtime as cudart

        report["cuda_bindings"] = importlib.metadata.version("cuda-bindings")
        fn = getattr(cudart, "cudaMemcpyBatchAsync", None)
        report["cudaMemcpyBatchAsync"] = (fn.__doc__ or "present")[:1500] if fn else None
        report["cudaMemcpyAttributes_fields"] = [
            n for n in dir(cudart.cudaMemcpyAttributes()) if not n.startswith("_")
        ]
    except Exception as exc:  # noqa: BLE001 - report, never fail
        report["cuda_bindings_error"] = repr(exc)
    import torch.distributed._symmetric_memory as symm_mem

    report["symm_mem_api"] = sorted(n for n in dir(symm_mem) if not n.startswith("_"))
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as coll
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group
    import torch.distributed.fsdp._fully_shard._fsdp_state as state

    report["foreach_reduce_signature"] = str(inspect.signature(coll.foreach_reduce))
    report["foreach_all_gather_signature"] = str(inspect.signature(coll.foreach_all_gather))
    report["copy_out_signature"] = str(inspect.signature(coll.foreach_all_gather_copy_out))
    report["foreach_reduce_returns"] = [
        line.strip()
        for line in inspect.getsource(coll.foreach_reduce).splitlines()
        if line.strip().startswith("return")
    ]
    report["param_group_uses"] = [
        n
        for n in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
        if hasattr(group, n)
    ]
    report["fsdp_state_group_attr"] = [
        line.strip()
        for line in inspect.getsource(state.FSDPState.__init__).splitlines()
        if "_fsdp_param_group" in line
    ]
    return report


if __name__ == "__main__":
    print(json.dumps(probe(), indent=1, default=str))
