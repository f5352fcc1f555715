"""The Qwen3-VL vision tower as an export-friendly torch module.

Same arithmetic as transformers' Qwen3VLVisionModel, but every grid-dependent quantity arrives as
a per-patch input (see vision_metadata), so one static graph with a dynamic patch count serves
any mix of images. Parameter names mirror the checkpoint's (under `model.visual.`), so weights
load by name. RoPE, LayerNorm and softmax always run in fp32, whatever the compute dtype.

Two graph variants share everything but how attention keeps to its segments: VisionTower (portable)
masks an N x N score matrix; PluginVisionTower calls the varlen attention plugin on cu_seqlens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..common.contracts import VISUAL_PREFIX
from ..errors import CheckpointError
from ..hf.checkpoint import VisionConfig
from .plugin_op import varlen_attention

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class LayerNormFp32(nn.LayerNorm):
    """LayerNorm computed in fp32 with fp32 parameters; output in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise CheckpointError(f"vision hidden_act {cfg.hidden_act!r} is not supported")
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SegmentAttention(Protocol):
    """Scaled dot-product attention of q, k, v [N, heads, head_dim] within each attention segment."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class MaskedSegmentAttention:
    """The portable variant: dense scores over all N patches, -inf outside each patch's segment."""

    def __init__(self, segment_start: torch.Tensor):
        # The running sum is in fp32 because TensorRT's CumSum takes float types only (exact below
        # 2**24 patches).
        segment = torch.cumsum(segment_start.float(), dim=0)
        same = segment.unsqueeze(0) == segment.unsqueeze(1)
        self.mask_bias = torch.where(same, 0.0, float("-inf"))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim]
        scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(1, 2)).float() + self.mask_bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1)


class PluginSegmentAttention:
    """The plugin variant: one varlen attention node per block; fp32 softmax inside the plugin."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen_carrier: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self.max_seqlen_carrier = max_seqlen_carrier

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, self.cu_seqlens, self.max_seqlen_carrier)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: SegmentAttention) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, heads, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # the same angles for every head
        qf, kf = q.float(), k.float()
        q = (qf * cos + _rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + _rotate_half(kf) * sin).to(x.dtype)
        return self.proj(attend(q, k, v).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = LayerNormFp32(cfg.hidden_size, eps=1e-6)
        self.norm2 = LayerNormFp32(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: SegmentAttention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """2x2 spatial merge into LLM tokens; DeepStack mergers normalize after the shuffle."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNormFp32(self.merged_size if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        # Conv3d with kernel == stride over one patch is a Linear over the flattened patch.
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class VisionTower(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )
        self.register_buffer("inv_freq", _rope_inv_freq(cfg), persistent=False)

    @staticmethod
    def checkpoint_names(cfg: VisionConfig) -> list[str]:
        """The checkpoint tensors this module needs, with their full checkpoint names."""
        with torch.device("meta"):
            return [VISUAL_PREFIX + name for name in VisionTower(cfg).state_dict()]

    @classmethod
    def from_checkpoint_tensors(
        cls, cfg: VisionConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> VisionTower:
        """Builds the tower from tensors named as in the checkpoint, without a random init pass.

        Weights are cast to `dtype`; LayerNorm parameters and the position grid stay fp32.
        """
        with torch.device("meta"):
            tower = cls(cfg)
        state = {}
        for name, param in tower.state_dict().items():
            src = tensors.get(VISUAL_PREFIX + name)
            if src is None:
                raise CheckpointError(f"checkpoint lacks vision tensor '{VISUAL_PREFIX + name}'")
            if name == "patch_embed.proj.weight":
                src = src.reshape(src.shape[0], -1)
            if tuple(src.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"vision tensor '{VISUAL_PREFIX + name}' has shape {list(src.shape)}, "
                    f"config implies {list(param.shape)}"
                )
            state[name] = src
        tower.load_state_dict(state, assign=True)
        tower.to(dtype)
        tower.inv_freq = _rope_inv_freq(cfg)  # after the cast: rotary frequencies stay fp32
        for module in tower.modules():
            if isinstance(module, LayerNormFp32):
                module.float()
        tower.pos_embed.float()
        return tower.eval()

    def forward(
        self,
        pixel_values: torch.Tensor,
        pos_embed_idx: torch.Tensor,
        pos_embed_w: torch.Tensor,
        rotary_pos: torch.Tensor,
        segment_start: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(pixel_values, pos_embed_idx, pos_embed_w, rotary_pos, MaskedSegmentAttention(segment_start))

    def encode(
        self,
        pixel_values: torch.Tensor,
        pos_embed_idx: torch.Tensor,
        pos_embed_w: torch.Tensor,
        rotary_pos: torch.Tensor,
        attend: SegmentAttention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image_embeds, deepstack_embeds); `attend` keeps attention inside each segment."""
        dtype = self.patch_embed.proj.weight.dtype
        x = self.patch_embed(pixel_values.to(dtype))
        pos = (self.pos_embed(pos_embed_idx) * pos_embed_w.unsqueeze(-1)).sum(dim=1)
        x = x + pos.to(dtype)

        # Rotary angles: head_dim/4 frequencies for the row, the same for the column, twice.
        freqs = (rotary_pos.float().unsqueeze(-1) * self.inv_freq).reshape(rotary_pos.shape[0], -1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()

        deepstack = []
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, attend)
            if layer in self.cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(layer)]
                deepstack.append(merger(x))
        return self.merger(x), torch.stack(deepstack)


class PluginVisionTower(VisionTower):
    """The plugin graph variant: the same weights and arithmetic, attention on cu_seqlens."""

    def forward(  # type: ignore[override]  # the plugin variant's inputs (contracts.VISION_GRAPH_INPUTS)
        self,
        pixel_values: torch.Tensor,
        pos_embed_idx: torch.Tensor,
        pos_embed_w: torch.Tensor,
        rotary_pos: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen_carrier: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attend = PluginSegmentAttention(cu_seqlens, max_seqlen_carrier)
        return self.encode(pixel_values, pos_embed_idx, pos_embed_w, rotary_pos, attend)


def _rope_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """head_dim/4 inverse frequencies, shared by the row and the column halves of the rotation."""
    dim = cfg.head_dim // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
