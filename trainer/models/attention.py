"""Multi-head self-attention on top of PyTorch's fused scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention over a (batch, tokens, dim) sequence.

    Q, K and V come from one ``dim -> 3 * dim`` Linear (one large matmul uses the GPU better than
    three), laid out as ``[q | k | v]`` of ``num_heads`` contiguous chunks each, as
    ``nn.MultiheadAttention.in_proj_weight``, so weights copy between the two. The attention is
    ``F.scaled_dot_product_attention``: FlashAttention / memory-efficient kernels where the inputs
    allow, never materialising the full attention matrix then."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_dropout: float = 0.0,
                 proj_dropout: float = 0.0, proj_bias: bool = True) -> None:
        super().__init__()
        if dim <= 0 or num_heads <= 0:
            raise ValueError(f"dim and num_heads must be positive, got dim={dim}, num_heads={num_heads}")
        if dim % num_heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}): every head gets "
                             "dim // num_heads channels")
        for name, p in (("attn_dropout", attn_dropout), ("proj_dropout", proj_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """Attend over the tokens of ``x`` (shape ``(B, N, dim)``); returns the same shape.

        ``attn_mask`` follows ``scaled_dot_product_attention``'s convention, which is the
        *opposite* of ``nn.MultiheadAttention``'s for booleans: ``True`` means "may attend". A
        float mask is added to the attention logits (use ``-inf`` to block). Shapes: ``(N, N)``,
        ``(B, N, N)`` or ``(B, 1 or num_heads, N, N)``. A query row that may attend to nothing
        yields NaN, as in SDPA. ``is_causal`` may be combined with a mask; both then apply."""
        _, tokens, dim = x.shape
        if dim != self.dim:
            raise ValueError(f"expected last dimension {self.dim}, got {dim}")
        q, k, v = self.project_qkv(x)
        mask = _prepare_mask(attn_mask, is_causal, tokens, x.device)
        # SDPA refuses an explicit mask together with is_causal; _prepare_mask merged them.
        return self.attend(q, k, v, mask, is_causal and mask is None)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v, each (B, heads, N, head_dim): one matmul, then views and one permute (unflatten
        names no batch or length size, which torch.compile(dynamic=True) would otherwise specialise)."""
        return self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
        """SDPA over the heads (dropout on its weights in training), the heads joined, then the output
        projection and its dropout."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             dropout_p=self.attn_dropout if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).flatten(2)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, attn_dropout={self.attn_dropout}"


def _prepare_mask(attn_mask: torch.Tensor | None, is_causal: bool, tokens: int,
                  device: torch.device) -> torch.Tensor | None:
    if attn_mask is None:
        return None
    if attn_mask.dim() == 3:
        # A per-sample (B, N, N) mask would otherwise broadcast its batch axis against the heads.
        attn_mask = attn_mask.unsqueeze(1)
    if not is_causal:
        return attn_mask
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))
