"""Wan2.2 diffusion-transformer hyper-parameters and the published flavors.

Shapes follow the Wan2.2 release (``wan/configs/wan_t2v_A14B.py`` and
``wan/configs/wan_ti2v_5B.py``): one T2V-A14B expert is dim 5120, FFN 13824, 40 heads,
40 layers on 16-channel latents (VAE stride (4, 8, 8)); TI2V-5B is dim 3072, FFN 14336,
24 heads, 30 layers on 48-channel latents (VAE stride (4, 16, 16)).
"""

import math
from dataclasses import dataclass

from torch import nn
from torchtitan.config import JobConfig
from torchtitan.protocols.model import BaseModelArgs

from .job_config import Wan22DataConfig, wan22_data_config


@dataclass
class Wan22ModelArgs(BaseModelArgs):
    """Architecture of one Wan2.2 DiT expert.

    The model maps noisy latents ``[B, in_channels, F, H, W]`` to a prediction
    ``[B, out_channels, F, H, W]``; ``F``, ``H`` and ``W`` must be divisible by
    ``patch_size``. Text conditioning is ``[B, L, text_dim]`` umT5 embeddings with
    ``L <= text_len`` (shorter inputs are zero-padded to ``text_len``, as Wan does).
    """

    dim: int = 5120
    """Transformer width."""
    ffn_dim: int = 13824
    """Hidden width of each block's GELU(tanh) MLP."""
    num_heads: int = 40
    """Attention heads; ``dim // num_heads`` must be even (RoPE works on pairs)."""
    num_layers: int = 40
    """Number of transformer blocks (each is one FSDP unit)."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(frame, height, width) patch of the Conv3d patch embedding."""
    in_channels: int = 16
    """Latent channels read by the patch embedding (16 for Wan2.1 VAE, 48 for Wan2.2 VAE)."""
    out_channels: int = 16
    """Latent channels predicted by the head."""
    text_dim: int = 4096
    """Width of the umT5-XXL text embeddings."""
    text_len: int = 512
    """Text sequence length after zero padding."""
    freq_dim: int = 256
    """Width of the sinusoidal timestep embedding."""
    qk_norm: bool = True
    """RMSNorm over the full ``dim`` on q and k in self- and cross-attention."""
    cross_attn_norm: bool = True
    """Affine LayerNorm (``norm3``) before cross-attention."""
    eps: float = 1e-6
    """Epsilon of every LayerNorm/RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base shared by the frame, height and width axes."""
    rope_max_positions: int = 1024
    """Largest position index per axis (Wan precomputes 1024); longer grids are rejected."""
    latent_shape: tuple[int, int, int] = (21, 60, 104)
    """(F, H, W) latent grid used only for FLOP accounting; set by ``update_from_config``."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        """Copy the data shape of this run (``[wan22]`` section) for FLOP accounting."""
        data_config: Wan22DataConfig = wan22_data_config(job_config)
        self.latent_shape = (
            data_config.latent_frames,
            data_config.latent_height,
            data_config.latent_width,
        )
        if job_config.parallelism.tensor_parallel_degree > 1:
            raise NotImplementedError("Wan2.2 does not implement tensor parallelism.")
        if job_config.parallelism.context_parallel_degree > 1:
            raise NotImplementedError("Wan2.2 does not implement context parallelism.")

    def video_tokens(self) -> int:
        """Tokens per sample after patchify for ``latent_shape``."""
        return math.prod(n // p for n, p in zip(self.latent_shape, self.patch_size))

    def forward_flops_per_sample(self) -> int:
        """Matmul + attention FLOPs of one forward pass on one ``latent_shape`` sample.

        Counts 2 FLOPs per multiply-add of every Linear/Conv3d and of the attention
        score (QK^T) and value (PV) products; norms, RoPE and elementwise ops are left out.
        """
        d, f, n_text = self.dim, self.ffn_dim, self.text_len
        s = self.video_tokens()
        patch = math.prod(self.patch_size)
        per_block = (
            2 * s * 4 * d * d  # self-attn q, k, v, o
            + 2 * 2 * s * s * d  # self-attn scores and values
            + 2 * s * 2 * d * d  # cross-attn q, o (video tokens)
            + 2 * n_text * 2 * d * d  # cross-attn k, v (text tokens)
            + 2 * 2 * s * n_text * d  # cross-attn scores and values
            + 2 * s * 2 * d * f  # FFN
        )
        embed = (
            2 * s * self.in_channels * patch * d  # patch embedding
            + 2 * n_text * (self.text_dim * d + d * d)  # text embedding
            + 2 * s * d * self.out_channels * patch  # head
        )
        return self.num_layers * per_block + embed

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Return (parameter count, training FLOPs per latent element).

        torchtitan's metrics multiply the second number by ``labels.numel()`` per second;
        our labels are the latents (``C * F * H * W`` elements per sample), so this returns
        ``3 * forward_flops_per_sample / (C * F * H * W)`` and MFU comes out right.
        ``seq_len`` is ignored (video length comes from ``latent_shape``).
        """
        del seq_len
        nparams = sum(p.numel() for p in model.parameters())
        elements = self.out_channels * math.prod(self.latent_shape)
        return nparams, 3 * self.forward_flops_per_sample() // elements

    def expected_num_params(self) -> int:
        """Closed-form parameter count (the tests check the built model against it)."""
        d, f = self.dim, self.ffn_dim
        patch = math.prod(self.patch_size)
        norm_qk = 2 * d if self.qk_norm else 0
        attention = 4 * (d * d + d) + norm_qk
        block = (
            2 * attention  # self- and cross-attention
            + (2 * d if self.cross_attn_norm else 0)  # norm3 weight + bias
            + (d * f + f)
            + (f * d + d)  # FFN
            + 6 * d  # modulation
        )
        embeddings = (
            (self.in_channels * patch * d + d)  # patch embedding
            + (self.text_dim * d + d)
            + (d * d + d)  # text embedding
            + (self.freq_dim * d + d)
            + (d * d + d)  # time embedding
            + (d * 6 * d + 6 * d)  # time projection
        )
        head = (d * self.out_channels * patch + self.out_channels * patch) + 2 * d
        return self.num_layers * block + embeddings + head


wan22_configs: dict[str, Wan22ModelArgs] = {
    # Tiny: trains on a CPU in seconds; 4 heads of width 32 keep all three RoPE axes non-empty.
    "debugmodel": Wan22ModelArgs(
        dim=128,
        ffn_dim=256,
        num_heads=4,
        num_layers=2,
        in_channels=16,
        out_channels=16,
        text_len=64,
        latent_shape=(3, 8, 8),
    ),
    # One expert (high- or low-noise) of Wan2.2 T2V-A14B.
    "t2v_a14b": Wan22ModelArgs(
        dim=5120,
        ffn_dim=13824,
        num_heads=40,
        num_layers=40,
        in_channels=16,
        out_channels=16,
    ),
    # Full-width, half-depth A14B expert for 2-GPU runs: the 40-layer expert's fp32 params,
    # grads and AdamW states alone take 114 GB (106 GiB) per GPU under 2-way FSDP.
    "t2v_a14b_20layers": Wan22ModelArgs(
        dim=5120,
        ffn_dim=13824,
        num_heads=40,
        num_layers=20,
        in_channels=16,
        out_channels=16,
    ),
    # Wan2.2 TI2V-5B (single model, Wan2.2 VAE with 48 latent channels).
    "ti2v_5b": Wan22ModelArgs(
        dim=3072,
        ffn_dim=14336,
        num_heads=24,
        num_layers=30,
        in_channels=48,
        out_channels=48,
        latent_shape=(21, 44, 80),
    ),
}
