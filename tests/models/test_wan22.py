"""CPU tests of the Wan2.2 DiT: sizes, a naive float64 reference, flow matching, data, FSDP.

Run: python -m pytest tests/models/test_wan22.py -q
"""

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from models.wan22 import build_wan22_train_spec
from models.wan22.args import Wan22ModelArgs, wan22_configs
from models.wan22.data import (
    LatentFolder,
    SyntheticLatents,
    Wan22FlowMatchingDataset,
    build_wan22_dataloader,
    write_latent_folder,
)
from models.wan22.job_config import Wan22DataConfig
from models.wan22.loss import (
    add_noise,
    flow_matching_loss,
    sample_timesteps,
    shift_sigma,
    unshift_sigma,
)
from models.wan22.model import Wan22Model

# Exact parameter counts of one expert, from ``Wan22ModelArgs.expected_num_params`` and
# checked against the built module. Published sizes: "A14B" = two 14B experts (27B total,
# 14B active) and "TI2V-5B" = 5B (Wan2.2 README / model cards).
T2V_A14B_PARAMS = 14_288_491_584
TI2V_5B_PARAMS = 4_999_787_712


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Tiny matmuls run fastest (and least disturbed by other jobs) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def meta_param_count(flavor: str) -> int:
    with torch.device("meta"):
        model = Wan22Model(wan22_configs[flavor])
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "flavor, exact, published, tolerance",
    [
        ("t2v_a14b", T2V_A14B_PARAMS, 14e9, 0.03),
        ("ti2v_5b", TI2V_5B_PARAMS, 5e9, 0.01),
    ],
)
def test_param_counts(flavor: str, exact: int, published: float, tolerance: float):
    count = meta_param_count(flavor)
    assert count == exact
    assert count == wan22_configs[flavor].expected_num_params()
    assert abs(count - published) / published < tolerance


def test_param_count_formula_by_hand():
    """Per block: 2 attentions of 4(d^2+d)+2d, norm3 2d, FFN 2df+f+d, modulation 6d."""
    d, f, layers = 5120, 13824, 40
    block = 2 * (4 * (d * d + d) + 2 * d) + 2 * d + (2 * d * f + f + d) + 6 * d
    embeddings = (16 * 4 * d + d) + (4096 * d + d + d * d + d) + (256 * d + d + d * d + d)
    embeddings += 6 * d * d + 6 * d
    head = d * 64 + 64 + 2 * d
    assert layers * block + embeddings + head == T2V_A14B_PARAMS


def test_debug_forward_shape_and_dtypes():
    args = wan22_configs["debugmodel"]
    torch.manual_seed(0)
    model = Wan22Model(args)
    model.init_weights()
    latents = torch.randn(2, args.in_channels, 3, 8, 8)
    text = torch.randn(2, 10, args.text_dim)
    out = model(latents, torch.tensor([0.0, 999.0]), text)
    assert out.shape == latents.shape and out.dtype == torch.float32
    # bf16 parameters: output still float32 and finite.
    model_bf16 = Wan22Model(args).to(torch.bfloat16)
    model_bf16.load_state_dict(model.state_dict())
    with torch.no_grad():
        model_bf16.head.head.weight.normal_(std=0.02)
    out = model_bf16(latents, torch.tensor([0.0, 999.0]), text)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_forward_rejects_bad_shapes():
    args = wan22_configs["debugmodel"]
    model = Wan22Model(args)
    model.init_weights()
    ok_text = torch.randn(1, 4, args.text_dim)
    with pytest.raises(ValueError, match="latents must be"):
        model(torch.randn(1, 3, 1, 4, 4), torch.zeros(1), ok_text)
    with pytest.raises(ValueError, match="not divisible"):
        model(torch.randn(1, 16, 1, 3, 4), torch.zeros(1), ok_text)
    with pytest.raises(ValueError, match="text_emb must be"):
        model(torch.randn(1, 16, 1, 4, 4), torch.zeros(1), torch.randn(1, 65, 4096))
    with pytest.raises(ValueError, match="timesteps must be"):
        model(torch.randn(1, 16, 1, 4, 4), torch.zeros(2), ok_text)


# --------------------------------------------------------------------------------------
# Naive float64 reference, written from the published architecture independently of
# models/wan22/model.py: explicit loops over batch and heads, complex-number RoPE.
# --------------------------------------------------------------------------------------


def _linear(p: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def _layer_norm(x, eps, weight=None, bias=None):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight + bias
    return y


def _rms_norm(x, eps, weight):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight


def _rope_table(args: Wan22ModelArgs, grid) -> torch.Tensor:
    """Complex rotations [S, head_dim/2]: Wan's rope_params per axis, dims d-4(d//6),
    2(d//6), 2(d//6), frequencies 1/theta^(2j/dim_axis)."""
    d = args.head_dim
    axis_dims = [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)]
    rows = []
    for f in range(grid[0]):
        for h in range(grid[1]):
            for w in range(grid[2]):
                row = []
                for pos, dim_axis in zip((f, h, w), axis_dims):
                    for j in range(0, dim_axis, 2):
                        angle = pos / args.rope_theta ** (j / dim_axis)
                        row.append(complex(math.cos(angle), math.sin(angle)))
                rows.append(row)
    return torch.tensor(rows, dtype=torch.complex128)


def _rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [S, head_dim] real -> rotated, pairs (2i, 2i+1) as complex numbers."""
    xc = torch.view_as_complex(x.reshape(x.shape[0], -1, 2).contiguous())
    return torch.view_as_real(xc * table).reshape(x.shape)


def _attention(q, k, v, num_heads):
    """q [Sq, D], k/v [Sk, D] -> [Sq, D]; explicit loop over heads, einsum products."""
    hd = q.shape[-1] // num_heads
    outs = []
    for h in range(num_heads):
        sl = slice(h * hd, (h + 1) * hd)
        scores = torch.einsum("qd,kd->qk", q[:, sl], k[:, sl]) / math.sqrt(hd)
        weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
        weights = weights / weights.sum(-1, keepdim=True)
        outs.append(torch.einsum("qk,kd->qd", weights, v[:, sl]))
    return torch.cat(outs, dim=-1)


def reference_forward(p: dict, args: Wan22ModelArgs, latents, timesteps, text_emb):
    batch, _, frames, height, width = latents.shape
    pf, ph, pw = args.patch_size
    grid = (frames // pf, height // ph, width // pw)
    rope = _rope_table(args, grid)
    half = args.freq_dim // 2
    outputs = []
    for b in range(batch):
        # Patch embedding: one token per (f, h, w) patch.
        tokens = []
        for f in range(grid[0]):
            for h in range(grid[1]):
                for w in range(grid[2]):
                    patch = latents[
                        b, :, f * pf : (f + 1) * pf, h * ph : (h + 1) * ph, w * pw : (w + 1) * pw
                    ]
                    tokens.append(
                        torch.einsum("dcijk,cijk->d", p["patch_embedding.weight"], patch)
                        + p["patch_embedding.bias"]
                    )
        x = torch.stack(tokens)
        # Timestep embedding.
        freqs = torch.tensor([10000 ** (-i / half) for i in range(half)], dtype=torch.float64)
        angles = timesteps[b] * freqs
        sinusoid = torch.cat([torch.cos(angles), torch.sin(angles)])
        e = _linear(p, "time_embedding.2", _silu(_linear(p, "time_embedding.0", sinusoid)))
        e0 = _linear(p, "time_projection.1", _silu(e)).reshape(6, args.dim)
        # Text embedding of the zero-padded prompt.
        text = torch.zeros(args.text_len, args.text_dim, dtype=torch.float64)
        text[: text_emb.shape[1]] = text_emb[b]
        context = _linear(p, "text_embedding.2", _gelu_tanh(_linear(p, "text_embedding.0", text)))
        for i in range(args.num_layers):
            pre = f"layers.{i}."
            m = p[pre + "modulation"][0] + e0
            # Self-attention.
            h_in = _layer_norm(x, args.eps) * (1 + m[1]) + m[0]
            q = _rms_norm(
                _linear(p, pre + "self_attn.q", h_in), args.eps, p[pre + "self_attn.norm_q.weight"]
            )
            k = _rms_norm(
                _linear(p, pre + "self_attn.k", h_in), args.eps, p[pre + "self_attn.norm_k.weight"]
            )
            v = _linear(p, pre + "self_attn.v", h_in)
            hd = args.head_dim
            q = torch.cat(
                [_rope(q[:, j * hd : (j + 1) * hd], rope) for j in range(args.num_heads)], -1
            )
            k = torch.cat(
                [_rope(k[:, j * hd : (j + 1) * hd], rope) for j in range(args.num_heads)], -1
            )
            y = _linear(p, pre + "self_attn.o", _attention(q, k, v, args.num_heads))
            x = x + y * m[2]
            # Cross-attention.
            xn = _layer_norm(x, args.eps, p[pre + "norm3.weight"], p[pre + "norm3.bias"])
            q = _rms_norm(
                _linear(p, pre + "cross_attn.q", xn), args.eps, p[pre + "cross_attn.norm_q.weight"]
            )
            k = _rms_norm(
                _linear(p, pre + "cross_attn.k", context),
                args.eps,
                p[pre + "cross_attn.norm_k.weight"],
            )
            v = _linear(p, pre + "cross_attn.v", context)
            x = x + _linear(p, pre + "cross_attn.o", _attention(q, k, v, args.num_heads))
            # FFN.
            h_in = _layer_norm(x, args.eps) * (1 + m[4]) + m[3]
            y = _linear(p, pre + "ffn.2", _gelu_tanh(_linear(p, pre + "ffn.0", h_in)))
            x = x + y * m[5]
        # Head and unpatchify: output features ordered (pf, ph, pw, c).
        mh = p["head.modulation"][0] + e
        y = _linear(p, "head.head", _layer_norm(x, args.eps) * (1 + mh[1]) + mh[0])
        out = torch.zeros(args.out_channels, frames, height, width, dtype=torch.float64)
        token = 0
        for f in range(grid[0]):
            for h in range(grid[1]):
                for w in range(grid[2]):
                    feats = y[token].reshape(pf, ph, pw, args.out_channels)
                    for i in range(pf):
                        for j in range(ph):
                            for kk in range(pw):
                                out[:, f * pf + i, h * ph + j, w * pw + kk] = feats[i, j, kk]
                    token += 1
        outputs.append(out)
    return torch.stack(outputs)


TINY = Wan22ModelArgs(
    dim=48,
    ffn_dim=64,
    num_heads=2,
    num_layers=2,
    in_channels=4,
    out_channels=6,
    text_dim=32,
    text_len=8,
    freq_dim=16,
)
TINY_TRAIN = dataclasses.replace(TINY, out_channels=4)


@pytest.mark.parametrize("patch_size", [(1, 2, 2), (2, 1, 2)])
def test_forward_matches_naive_reference_float64(patch_size):
    args = dataclasses.replace(TINY, patch_size=patch_size)
    torch.manual_seed(0)
    model = Wan22Model(args).to(torch.float64)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3)
    latents = torch.randn(2, 4, 4, 4, 6, dtype=torch.float64)
    timesteps = torch.tensor([3.5, 912.25], dtype=torch.float64)
    text = torch.randn(2, 5, 32, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    expected = reference_forward(params, args, latents, timesteps, text)
    actual = model(latents, timesteps, text)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------
# Flow matching and the expert split
# --------------------------------------------------------------------------------------


def test_add_noise_and_loss_are_mean_mse_after_trainer_division():
    x0, noise = torch.randn(2, 3, 1, 2, 2), torch.randn(2, 3, 1, 2, 2)
    sample = add_noise(x0, torch.tensor([0.0, 1000.0]), noise)
    torch.testing.assert_close(sample.noisy_latents[0], x0[0])
    torch.testing.assert_close(sample.noisy_latents[1], noise[1])
    torch.testing.assert_close(sample.target, noise - x0)
    pred = torch.randn_like(x0)
    # The Trainer divides by the number of labels != -100: all elements.
    valid = (sample.target != -100).sum()
    torch.testing.assert_close(
        flow_matching_loss(pred, sample.target) / valid, F.mse_loss(pred, sample.target)
    )


@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
def test_expert_timestep_ranges(shift):
    gen = torch.Generator().manual_seed(0)
    high = sample_timesteps(4000, "high_noise", 0.875, shift, gen)
    low = sample_timesteps(4000, "low_noise", 0.875, shift, gen)
    both = sample_timesteps(4000, "both", 0.875, shift, gen)
    assert high.dtype == torch.float32
    assert (high >= 875.0).all() and (high <= 1000.0).all()
    assert (low < 875.0).all() and (low >= 0.0).all()
    assert (both >= 0.0).all() and (both <= 1000.0).all()
    # Shifted schedule: P(t >= 875) = 1 - u(0.875), u the inverse shift.
    expected_high = 1 - unshift_sigma(0.875, shift)
    assert abs((both >= 875).float().mean().item() - expected_high) < 0.03
    u = torch.rand(100, dtype=torch.float64)
    torch.testing.assert_close(
        torch.tensor(
            [unshift_sigma(s, shift) for s in shift_sigma(u, shift).tolist()], dtype=torch.float64
        ),
        u,
    )
    with pytest.raises(ValueError, match="Unknown expert"):
        sample_timesteps(1, "medium_noise", 0.875, shift, gen)


def _stack(samples):
    inputs = {k: torch.stack([s[0][k] for s in samples]) for k in samples[0][0]}
    return inputs, torch.stack([s[1] for s in samples])


def test_flow_matching_loss_decreases_on_debug_flavor():
    args = wan22_configs["debugmodel"]
    torch.manual_seed(0)
    model = Wan22Model(args)
    model.init_weights()
    source = SyntheticLatents((args.in_channels, 3, 4, 4), args.text_len, args.text_dim, 0)
    dataset = Wan22FlowMatchingDataset(source, Wan22DataConfig(expert="low_noise"), args.text_len)
    inputs, target = _stack([dataset.sample(i) for i in range(2)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        pred = model(inputs["input"], timesteps=inputs["timesteps"], text_emb=inputs["text_emb"])
        loss = flow_matching_loss(pred, target) / target.numel()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0], losses


# --------------------------------------------------------------------------------------
# Data: determinism, sharding, checkpointing, the folder format
# --------------------------------------------------------------------------------------


def _tiny_dataset(rank=0, world=1, expert="both", source=None):
    source = source or SyntheticLatents((4, 1, 2, 2), 8, 32, seed=7)
    return Wan22FlowMatchingDataset(
        source, Wan22DataConfig(expert=expert, seed=7), 8, dp_rank=rank, dp_world_size=world
    )


def test_dataset_deterministic_sharded_and_resumable():
    single = [t for _, t in zip(range(6), _tiny_dataset())]
    rank0 = [t for _, t in zip(range(3), _tiny_dataset(0, 2))]
    rank1 = [t for _, t in zip(range(3), _tiny_dataset(1, 2))]
    interleaved = [rank0[0], rank1[0], rank0[1], rank1[1], rank0[2], rank1[2]]
    for (a_in, a_tgt), (b_in, b_tgt) in zip(single, interleaved):
        torch.testing.assert_close(a_tgt, b_tgt)
        for key in a_in:
            torch.testing.assert_close(a_in[key], b_in[key])
    assert not torch.equal(single[0][1], single[1][1])
    high = [s[0]["timesteps"].item() for _, s in zip(range(20), _tiny_dataset(expert="high_noise"))]
    assert min(high) >= 875.0

    dataset = _tiny_dataset()
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    state = dataset.state_dict()
    resumed = _tiny_dataset()
    resumed.load_state_dict(state)
    torch.testing.assert_close(next(iter(resumed))[1], single[3][1])


def _job_config(flavor="debugmodel", batch=2, **wan22):
    from torchtitan.config import JobConfig

    job_config = JobConfig()
    job_config.model.flavor = flavor
    job_config.training.local_batch_size = batch
    if wan22:
        job_config.wan22 = Wan22DataConfig(**wan22)
    return job_config


def test_dataloader_batches_and_checkpoint_state():
    job_config = _job_config(latent_frames=2, latent_height=4, latent_width=4)
    loader = build_wan22_dataloader(2, 1, None, job_config)
    iterator = iter(loader)
    inputs, target = next(iterator)
    args = wan22_configs["debugmodel"]
    assert inputs["input"].shape == (2, args.in_channels, 2, 4, 4) == target.shape
    assert inputs["timesteps"].shape == (2,)
    assert inputs["text_emb"].shape == (2, args.text_len, args.text_dim)
    state = loader.state_dict()
    expected_next = next(iterator)[1]
    restored = build_wan22_dataloader(2, 1, None, job_config)
    restored.load_state_dict(state)
    torch.testing.assert_close(next(iter(restored))[1], expected_next)
    # No [wan22] section: defaults (synthetic, 21x60x104 latents) are used.
    default_loader = build_wan22_dataloader(1, 0, None, _job_config(batch=1))
    assert next(iter(default_loader))[1].shape == (1, 16, 21, 60, 104)


def test_folder_round_trip(tmp_path: Path):
    torch.manual_seed(0)
    samples = [
        (torch.randn(16, 2, 4, 4).to(torch.bfloat16), torch.randn(length, 4096))
        for length in (3, 64, 10)
    ]
    write_latent_folder(tmp_path / "data", samples)
    folder = LatentFolder(tmp_path / "data", in_channels=16, text_dim=4096, text_len=64)
    assert folder.num_samples == 3
    for i, (latents, text) in enumerate(samples):
        got_latents, got_text = folder.get(i)
        assert torch.equal(got_latents, latents) and torch.equal(got_text, text)
    # Through the train-spec dataloader: 2 ranks, one epoch of 3 -> one full round.
    job_config = _job_config(source="folder", folder=str(tmp_path / "data"))
    job_config.training.local_batch_size = 1
    loader = build_wan22_dataloader(2, 0, None, job_config, infinite=False)
    batches = list(loader)
    assert len(batches) == 1
    inputs, target = batches[0]
    assert inputs["text_emb"].shape == (1, 64, 4096) and target.shape == (1, 16, 2, 4, 4)
    # Infinite: keeps going over epochs.
    loader = build_wan22_dataloader(2, 1, None, job_config)
    assert len([b for _, b in zip(range(5), loader)]) == 5


def test_folder_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LatentFolder(tmp_path / "nope", 16, 4096, 512)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="index.json is missing"):
        LatentFolder(tmp_path / "empty", 16, 4096, 512)
    folder = write_latent_folder(
        tmp_path / "ok", [(torch.randn(16, 1, 2, 2), torch.randn(4, 4096))] * 2
    )
    with pytest.raises(ValueError, match="48"):
        LatentFolder(folder, 48, 4096, 512)
    # A sample whose tensor disagrees with the index.
    torch.save(
        {"latents": torch.randn(16, 1, 2, 3), "text_emb": torch.randn(4, 4096)},
        folder / "000001.pt",
    )
    reader = LatentFolder(folder, 16, 4096, 512)
    reader.get(0)
    with pytest.raises(ValueError, match="000001.pt: latents"):
        reader.get(1)
    torch.save(
        {"latents": torch.randn(16, 1, 2, 2), "text_emb": torch.randn(600, 4096)},
        folder / "000001.pt",
    )
    with pytest.raises(ValueError, match="000001.pt: text_emb"):
        reader.get(1)
    (folder / "000001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="missing, first: .*000001.pt"):
        LatentFolder(folder, 16, 4096, 512)
    index = json.loads((folder / "index.json").read_text())
    index["format"] = "something-else"
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="format"):
        LatentFolder(folder, 16, 4096, 512)
    with pytest.raises(ValueError, match="wan22.source"):
        build_wan22_dataloader(1, 0, None, _job_config(source="s3"))
    with pytest.raises(ValueError, match="wan22.folder or training.dataset_path"):
        build_wan22_dataloader(1, 0, None, _job_config(source="folder"))


def test_train_spec_fields():
    spec = build_wan22_train_spec()
    assert spec.model_cls is Wan22Model
    assert set(spec.model_args) == {"debugmodel", "t2v_a14b", "t2v_a14b_20layers", "ti2v_5b"}
    assert spec.pipelining_fn is None and spec.build_tokenizer_fn is None
    nparams, flops = wan22_configs["debugmodel"].get_nparams_and_flops(
        Wan22Model(wan22_configs["debugmodel"]), 0
    )
    assert nparams == wan22_configs["debugmodel"].expected_num_params() and flops > 0


# --------------------------------------------------------------------------------------
# FSDP on 2 gloo ranks equals single-process training
# --------------------------------------------------------------------------------------


def _fsdp_worker(rank: int, world: int, result_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from models.wan22.parallelize import apply_fsdp

    torch.set_num_threads(1)
    store = f"file://{os.path.join(result_dir, 'rendezvous')}"  # no TCP port to pick
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Wan22Model(TINY_TRAIN)
    model.init_weights()
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.1)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), torch.float32, torch.float32)
    for module in model.modules():  # gloo has no PREMUL_SUM
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = SyntheticLatents((4, 2, 2, 2), 8, 32, seed=3)
    losses = []
    for step in range(3):
        dataset = Wan22FlowMatchingDataset(
            source, Wan22DataConfig(seed=step), 8, dp_rank=rank, dp_world_size=world
        )
        inputs, target = _stack([s for _, s in zip(range(2), dataset)])
        optimizer.zero_grad()
        pred = model(inputs["input"], timesteps=inputs["timesteps"], text_emb=inputs["text_emb"])
        loss = flow_matching_loss(pred, target) / (target.numel() * world)
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss.detach())
        losses.append(loss.item())
    if rank == 0:
        torch.save(losses, os.path.join(result_dir, "losses.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_two_gloo_ranks_match_single_process(tmp_path: Path):
    world = 2
    # fork: the children inherit the imported modules (a spawn re-imports torchtitan, ~10 s).
    mp.start_processes(_fsdp_worker, args=(world, str(tmp_path)), nprocs=world, start_method="fork")
    fsdp_losses = torch.load(tmp_path / "losses.pt")

    torch.manual_seed(0)
    model = Wan22Model(TINY_TRAIN)
    model.init_weights()
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = SyntheticLatents((4, 2, 2, 2), 8, 32, seed=3)
    losses = []
    for step in range(3):
        dataset = Wan22FlowMatchingDataset(source, Wan22DataConfig(seed=step), 8)
        inputs, target = _stack([s for _, s in zip(range(2 * world), dataset)])
        optimizer.zero_grad()
        pred = model(inputs["input"], timesteps=inputs["timesteps"], text_emb=inputs["text_emb"])
        loss = flow_matching_loss(pred, target) / target.numel()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(fsdp_losses, losses, rtol=1e-4, atol=1e-5)
