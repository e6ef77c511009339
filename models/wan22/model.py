"""Wan2.2 diffusion transformer (one expert) in plain PyTorch.

Architecture of ``WanModel`` in Wan-Video/Wan2.2 ``wan/modules/model.py``; submodule names
match that checkpoint layout except ``blocks`` -> ``layers`` (torchtitan's AC and FSDP
helpers look for ``model.layers``).

Numerics under bf16 parameters: matmuls, attention and the residual stream run in the
parameter dtype; the timestep path (sinusoid, time MLP, modulation), norms, RoPE and the
output head run in float32 (float64 stays float64), as Wan runs them under fp32 autocast.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.protocols.model import ModelProtocol

from .args import Wan22ModelArgs


def _fp32(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 when the input already is (used by the fp64 reference test)."""
    return torch.promote_types(dtype, torch.float32)


class Float32Linear(nn.Linear):
    """Linear computed in float32 (float64 stays float64) whatever the parameter dtype.

    Used for the timestep MLP and the output head, which Wan runs under fp32 autocast.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _fp32(self.weight.dtype)
        bias = self.bias.to(dtype) if self.bias is not None else None
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)


class InputCastLinear(nn.Linear):
    """Linear that first casts its input to the parameter (compute) dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class PatchEmbedding(nn.Conv3d):
    """Conv3d patchifier that first casts its input to the parameter (compute) dtype.

    Its output dtype sets the dtype of the residual stream for the whole network.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


def sinusoidal_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """[B] timesteps -> [B, dim] = cat(cos(t * w), sin(t * w)), w_i = 10000^(-i / (dim/2)).

    Computed in float64 like Wan (t goes up to 1000, so float32 angles would lose ~1e-4 rad).
    """
    half = dim // 2
    t = timesteps.to(torch.float64)
    inv_freq = torch.pow(10000.0, -torch.arange(half, device=t.device, dtype=torch.float64) / half)
    angles = torch.outer(t, inv_freq)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def rope_pairs_per_axis(head_dim: int) -> tuple[int, int, int]:
    """Rotary pairs given to (frame, height, width): Wan's split of ``head_dim // 2``."""
    pairs = head_dim // 2
    return pairs - 2 * (pairs // 3), pairs // 3, pairs // 3


def rope_cos_sin(
    grid: tuple[int, int, int], head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [F*H*W, head_dim // 2] float64, of the 3D RoPE angles.

    Token order is (f, h, w) row-major (the Conv3d patch embedding's flatten order). The
    pairs of each axis use frequencies theta^(-j / n_axis), j < n_axis, times that axis'
    position; the three axes are concatenated in (frame, height, width) order.
    """
    angles = []
    for axis, (n_pairs, size) in enumerate(zip(rope_pairs_per_axis(head_dim), grid)):
        inv_freq = torch.pow(
            theta, -torch.arange(n_pairs, device=device, dtype=torch.float64) / n_pairs
        )
        axis_angles = torch.outer(torch.arange(size, device=device, dtype=torch.float64), inv_freq)
        view = [1, 1, 1, n_pairs]
        view[axis] = size
        angles.append(axis_angles.view(view).expand(*grid, n_pairs))
    flat = torch.cat(angles, dim=-1).reshape(math.prod(grid), head_dim // 2)
    return torch.cos(flat), torch.sin(flat)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, S, heads, head_dim] by the angles.

    Equal to Wan's complex product view_as_complex(x pairs) * exp(i * angle); done in
    float32 (float64 for float64 input) and returned in x's dtype.
    """
    dtype = _fp32(x.dtype)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos = cos.to(dtype)[None, :, None, :]
    sin = sin.to(dtype)[None, :, None, :]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    """Wan's RMSNorm: normalize in float32, cast back, then scale by ``weight``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.to(_fp32(x.dtype))
        normed = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 and returned in the input dtype (Wan's WanLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _fp32(x.dtype)
        weight = self.weight.to(dtype) if self.weight is not None else None
        bias = self.bias.to(dtype) if self.bias is not None else None
        out = F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)
        return out.to(x.dtype)

    def init_weights(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Attention(nn.Module):
    """Multi-head attention with q/k RMSNorm over the full width (Wan's qk-norm).

    Self-attention when ``context`` is None (with 3D RoPE on q and k), cross-attention
    over ``context`` [B, L, dim] otherwise (no RoPE, no mask: Wan attends to padded text).
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        source = x if context is None else context
        q = self.norm_q(self.q(x)).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.norm_k(self.k(source)).unflatten(-1, (self.num_heads, self.head_dim))
        v = self.v(source).unflatten(-1, (self.num_heads, self.head_dim))
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.o(out.transpose(1, 2).flatten(-2))

    def init_weights(self) -> None:
        for linear in (self.q, self.k, self.v, self.o):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        for norm in (self.norm_q, self.norm_k):
            if isinstance(norm, RMSNorm):
                norm.init_weights()


class TransformerBlock(nn.Module):
    """One Wan DiT block: AdaLN-modulated self-attention and FFN, plain cross-attention.

    ``modulation`` [1, 6, dim] plus the projected timestep embedding gives, in order,
    (shift, scale, gate) for self-attention and (shift, scale, gate) for the FFN.
    """

    def __init__(self, args: Wan22ModelArgs):
        super().__init__()
        dim = args.dim
        self.norm1 = LayerNorm(dim, eps=args.eps, elementwise_affine=False)
        self.self_attn = Attention(dim, args.num_heads, args.qk_norm, args.eps)
        self.norm3 = (
            LayerNorm(dim, eps=args.eps, elementwise_affine=True)
            if args.cross_attn_norm
            else nn.Identity()
        )
        self.cross_attn = Attention(dim, args.num_heads, args.qk_norm, args.eps)
        self.norm2 = LayerNorm(dim, eps=args.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(
            nn.Linear(dim, args.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(args.ffn_dim, dim),
        )
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))

    def forward(
        self,
        x: torch.Tensor,
        time_mod: torch.Tensor,
        context: torch.Tensor,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, S, dim], time_mod [B, 6, dim] (float32), context [B, L, dim] -> [B, S, dim]."""
        mod = self.modulation.to(time_mod.dtype) + time_mod
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unsqueeze(2).unbind(1)

        h = self.norm1(x).to(mod.dtype) * (1 + scale1) + shift1
        y = self.self_attn(h.to(x.dtype), rope=(rope_cos, rope_sin))
        x = x + (y.to(mod.dtype) * gate1).to(x.dtype)

        x = x + self.cross_attn(self.norm3(x), context=context)

        h = self.norm2(x).to(mod.dtype) * (1 + scale2) + shift2
        y = self.ffn(h.to(x.dtype))
        return x + (y.to(mod.dtype) * gate2).to(x.dtype)

    def init_weights(self) -> None:
        self.self_attn.init_weights()
        self.cross_attn.init_weights()
        if isinstance(self.norm3, LayerNorm):
            self.norm3.init_weights()
        for linear in (self.ffn[0], self.ffn[2]):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
        nn.init.normal_(self.modulation, std=self.modulation.shape[-1] ** -0.5)


class Head(nn.Module):
    """Output head: LayerNorm (no affine), (shift, scale) modulation, Linear, in float32."""

    def __init__(self, args: Wan22ModelArgs):
        super().__init__()
        self.norm = LayerNorm(args.dim, eps=args.eps, elementwise_affine=False)
        self.head = Float32Linear(args.dim, args.out_channels * math.prod(args.patch_size))
        self.modulation = nn.Parameter(torch.empty(1, 2, args.dim))

    def forward(self, x: torch.Tensor, time_emb: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim], time_emb [B, dim] (float32) -> [B, S, out_channels * prod(patch)]."""
        mod = self.modulation.to(time_emb.dtype) + time_emb.unsqueeze(1)
        shift, scale = mod.unsqueeze(2).unbind(1)
        h = self.norm(x).to(mod.dtype) * (1 + scale) + shift
        return self.head(h)

    def init_weights(self) -> None:
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        nn.init.normal_(self.modulation, std=self.modulation.shape[-1] ** -0.5)


class Wan22Model(ModelProtocol):
    """One Wan2.2 DiT expert: (noisy latents, timesteps, text embeddings) -> velocity.

    Contract of ``forward``:
        latents   [B, in_channels, F, H, W], F/H/W divisible by ``patch_size``
        timesteps [B] float in [0, 1000] (= 1000 * sigma of the flow-matching schedule)
        text_emb  [B, L, text_dim], L <= text_len; zero-padded to ``text_len`` here
        returns   [B, out_channels, F, H, W] float32 (float64 if the parameters are)
    """

    def __init__(self, model_args: Wan22ModelArgs):
        super().__init__(model_args)
        if model_args.dim % model_args.num_heads or model_args.head_dim % 2:
            raise ValueError(
                f"dim={model_args.dim} must split into num_heads={model_args.num_heads} "
                "heads of even width"
            )
        if min(rope_pairs_per_axis(model_args.head_dim)) < 1:
            raise ValueError(f"head_dim={model_args.head_dim} is too small for 3D RoPE (need >= 6)")
        self.model_args = model_args
        dim = model_args.dim
        self.patch_embedding = PatchEmbedding(
            model_args.in_channels,
            dim,
            kernel_size=model_args.patch_size,
            stride=model_args.patch_size,
        )
        self.text_embedding = nn.Sequential(
            InputCastLinear(model_args.text_dim, dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(dim, dim),
        )
        # The timestep path runs in float32 (Float32Linear) like Wan's fp32 autocast region.
        self.time_embedding = nn.Sequential(
            Float32Linear(model_args.freq_dim, dim), nn.SiLU(), Float32Linear(dim, dim)
        )
        self.time_projection = nn.Sequential(nn.SiLU(), Float32Linear(dim, 6 * dim))
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(model_args) for i in range(model_args.num_layers)}
        )
        self.head = Head(model_args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Wan's initialization: Xavier-uniform Linear/Conv weights, zero biases, N(0, 0.02)
        text and time embedding weights, zero output projection, N(0, 1/dim) modulation.
        The model has no buffers, so ``buffer_device`` is unused."""
        del buffer_device
        weight = self.patch_embedding.weight
        fan_in = math.prod(weight.shape[1:])
        bound = math.sqrt(6.0 / (fan_in + weight.shape[0]))
        nn.init.uniform_(weight, -bound, bound)
        nn.init.zeros_(self.patch_embedding.bias)
        for linear in (*self.text_embedding[0::2], *self.time_embedding[0::2]):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        nn.init.xavier_uniform_(self.time_projection[1].weight)
        nn.init.zeros_(self.time_projection[1].bias)
        for block in self.layers.values():
            block.init_weights()
        self.head.init_weights()

    def _check_inputs(
        self, latents: torch.Tensor, timesteps: torch.Tensor, text_emb: torch.Tensor
    ) -> tuple[int, int, int]:
        args = self.model_args
        if latents.dim() != 5 or latents.shape[1] != args.in_channels:
            raise ValueError(
                f"latents must be [B, {args.in_channels}, F, H, W]; got {list(latents.shape)}"
            )
        if any(n % p for n, p in zip(latents.shape[2:], args.patch_size)):
            raise ValueError(
                f"latent (F, H, W)={tuple(latents.shape[2:])} not divisible by "
                f"patch_size={args.patch_size}"
            )
        grid = tuple(n // p for n, p in zip(latents.shape[2:], args.patch_size))
        if max(grid) > args.rope_max_positions:
            raise ValueError(f"patch grid {grid} exceeds {args.rope_max_positions} positions")
        if timesteps.shape != (latents.shape[0],):
            raise ValueError(
                f"timesteps must be [B={latents.shape[0]}]; got {list(timesteps.shape)}"
            )
        if (
            text_emb.dim() != 3
            or text_emb.shape[0] != latents.shape[0]
            or text_emb.shape[1] > args.text_len
            or text_emb.shape[2] != args.text_dim
        ):
            raise ValueError(
                f"text_emb must be [B={latents.shape[0]}, L<={args.text_len}, "
                f"{args.text_dim}]; got {list(text_emb.shape)}"
            )
        return grid  # type: ignore[return-value]

    def forward(
        self, latents: torch.Tensor, timesteps: torch.Tensor, text_emb: torch.Tensor
    ) -> torch.Tensor:
        args = self.model_args
        grid = self._check_inputs(latents, timesteps, text_emb)

        # Patchify: [B, C, F, H, W] -> [B, S, dim], tokens in (f, h, w) order. The output
        # dtype (the parameter dtype) is the compute dtype of the residual stream.
        x = self.patch_embedding(latents).flatten(2).transpose(1, 2)
        rope_cos, rope_sin = (
            table.to(_fp32(x.dtype))
            for table in rope_cos_sin(grid, args.head_dim, args.rope_theta, x.device)
        )

        # Timestep path in float32: e [B, dim] for the head, time_mod [B, 6, dim] for blocks.
        e = self.time_embedding(sinusoidal_embedding(timesteps, args.freq_dim))
        time_mod = self.time_projection(e).unflatten(1, (6, args.dim))

        pad = args.text_len - text_emb.shape[1]
        context = self.text_embedding(F.pad(text_emb, (0, 0, 0, pad)))

        for block in self.layers.values():
            x = block(x, time_mod, context, rope_cos, rope_sin)

        return self.unpatchify(self.head(x, e), grid)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, pf*ph*pw*C] (channel fastest, Wan's order) -> [B, C, F, H, W]."""
        pf, ph, pw = self.model_args.patch_size
        c = self.model_args.out_channels
        f, h, w = grid
        x = x.reshape(x.shape[0], f, h, w, pf, ph, pw, c)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(x.shape[0], c, f * pf, h * ph, w * pw)
