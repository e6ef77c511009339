"""Parameter counts of the reference models on the meta device, against published sizes.

Published: Llama-3.1-70B 70.6B (Meta model card; the HF checkpoint holds 70,553,706,496);
Qwen3-30B-A3B 30.5B total, 3.3B activated (Qwen3 model card). Wan2.2 counts are checked in
tests/models/test_wan22.py.
"""

import pytest
import torch
from torchtitan.protocols.train_spec import get_train_spec

import torchtitan_tide.train_specs  # noqa: F401  (registers the specs)


def meta_model(spec_name: str, flavor: str):
    spec = get_train_spec(spec_name)
    args = spec.model_args[flavor]
    with torch.device("meta"):
        return spec.model_cls(args), args


def test_llama31_70b():
    model, _ = meta_model("llama3_tide", "70B")
    total = sum(p.numel() for p in model.parameters())
    assert total == 70_553_706_496
    assert abs(total / 70.6e9 - 1) < 0.005


def test_qwen3_30b_a3b_total_and_active():
    model, args = meta_model("qwen3_tide", "30B-A3B")
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    active = total - expert + expert * args.moe_args.top_k // args.moe_args.num_experts
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    assert abs(total / 30.5e9 - 1) < 0.005
    assert abs(active / 3.3e9 - 1) < 0.02


@pytest.mark.parametrize(
    "spec_name, flavor, layers",
    [("llama3_tide", "70B_4layers", 4), ("qwen3_tide", "30B-A3B_4layers", 4),
     ("qwen3_tide", "debugmodel_moe_2layers", 2)],
)
def test_reduced_depth_flavors_keep_width(spec_name, flavor, layers):
    model, args = meta_model(spec_name, flavor)
    assert len(model.layers) == layers == args.n_layers
