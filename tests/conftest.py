import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config, items):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA GPUs (run scripts/gpu/check.sh on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(skip_gpu)


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(autouse=True)
def _no_wandb_network(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))
