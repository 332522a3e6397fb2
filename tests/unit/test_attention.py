"""Self-attention through `scaled_dot_product_attention` with one fused QKV projection: equal to
a hand-written reference (boolean and additive masks, causal, both together) and to
`nn.MultiheadAttention`; SDPA is what runs; gradients reach every parameter and the input;
dropout only in training; bad configurations refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.models import attention as attention_module
from trainer.models.attention import SelfAttention

B, N, DIM, HEADS = 2, 7, 32, 4


def _reference(attn: SelfAttention, x: torch.Tensor,
               additive_mask: torch.Tensor | None) -> torch.Tensor:
    """Textbook attention from the module's own weights, no SDPA: softmax(QK^T/sqrt(d) + M)V."""
    b, n, dim = x.shape
    h, d = attn.num_heads, dim // attn.num_heads
    q, k, v = nn.functional.linear(x, attn.qkv.weight, attn.qkv.bias).split(dim, dim=-1)
    q, k, v = (t.reshape(b, n, h, d).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    if additive_mask is not None:
        scores = scores + additive_mask
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, dim)
    return nn.functional.linear(out, attn.proj.weight, attn.proj.bias)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def _random_allowed(*shape: int) -> torch.Tensor:
    # The diagonal stays allowed so that no query row is fully masked (that row would be NaN).
    allowed = torch.rand(*shape) > 0.4
    return allowed | torch.eye(shape[-1], dtype=torch.bool)


@pytest.fixture
def attn() -> SelfAttention:
    torch.manual_seed(0)
    return SelfAttention(DIM, HEADS).eval()


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(B, N, DIM)


def test_matches_naive_reference(attn: SelfAttention, x: torch.Tensor):
    torch.testing.assert_close(attn(x), _reference(attn, x, None), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(N, N), (B, N, N), (B, HEADS, N, N)])
def test_masks_match_reference(attn: SelfAttention, x: torch.Tensor, shape: tuple[int, ...]):
    torch.manual_seed(2)
    allowed = _random_allowed(*shape)
    # A (B, N, N) mask is per sample; the reference needs it aligned with (B, heads, N, N).
    ref_mask = _additive(allowed.unsqueeze(1) if len(shape) == 3 else allowed)
    expected = _reference(attn, x, ref_mask)
    torch.testing.assert_close(attn(x, attn_mask=allowed), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(attn(x, attn_mask=_additive(allowed)), expected, atol=1e-5, rtol=0)


def test_causal_matches_reference_with_causal_mask(attn: SelfAttention, x: torch.Tensor):
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    out = attn(x, is_causal=True)
    torch.testing.assert_close(out, _reference(attn, x, _additive(causal)), atol=1e-5, rtol=0)
    # Causal: token i ignores later tokens, so changing the last token leaves earlier outputs.
    x2 = x.clone()
    x2[:, -1] += 1.0
    torch.testing.assert_close(attn(x2, is_causal=True)[:, :-1], out[:, :-1], atol=1e-6, rtol=0)


def test_causal_combines_with_an_explicit_mask(attn: SelfAttention, x: torch.Tensor):
    torch.manual_seed(3)
    allowed = _random_allowed(B, 1, N, N)
    both = allowed & torch.ones(N, N, dtype=torch.bool).tril()
    expected = _reference(attn, x, _additive(both))
    torch.testing.assert_close(attn(x, attn_mask=allowed, is_causal=True), expected,
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(attn(x, attn_mask=_additive(allowed), is_causal=True), expected,
                               atol=1e-5, rtol=0)


def test_matches_torch_multihead_attention(attn: SelfAttention, x: torch.Tensor):
    mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(attn.qkv.weight)
        mha.in_proj_bias.copy_(attn.qkv.bias)
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias)
        expected, _ = mha(x, x, x, need_weights=False)
        torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=0)

        # MultiheadAttention's boolean mask means "blocked", SDPA's (and ours) "allowed".
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        expected, _ = mha(x, x, x, attn_mask=~causal, need_weights=False)
        torch.testing.assert_close(attn(x, is_causal=True), expected, atol=1e-5, rtol=0)


def test_one_fused_qkv_projection():
    attn = SelfAttention(DIM, HEADS, qkv_bias=False)
    linears = [m for m in attn.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2
    qkv = [m for m in linears if m.out_features == 3 * DIM]
    assert qkv == [attn.qkv] and attn.qkv.in_features == DIM and attn.qkv.bias is None
    assert attn.proj.in_features == attn.proj.out_features == DIM


def test_gradients_reach_every_parameter_and_the_input(attn: SelfAttention, x: torch.Tensor):
    attn.train()
    x = x.clone().requires_grad_()
    attn(x, is_causal=True).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_uses_scaled_dot_product_attention(monkeypatch: pytest.MonkeyPatch, x: torch.Tensor):
    real = attention_module.F.scaled_dot_product_attention
    calls: list[dict] = []

    def counting(q, k, v, **kwargs):
        calls.append({"shape": tuple(q.shape), **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counting)
    attn = SelfAttention(DIM, HEADS, attn_dropout=0.5)
    attn.eval()(x)
    attn.train()(x)
    assert len(calls) == 2
    assert calls[0]["shape"] == (B, HEADS, N, DIM // HEADS)
    # Attention dropout only while training.
    assert calls[0]["dropout_p"] == 0.0 and calls[1]["dropout_p"] == 0.5


def test_dropout_only_in_training(x: torch.Tensor):
    torch.manual_seed(0)
    attn = SelfAttention(DIM, HEADS, attn_dropout=0.3, proj_dropout=0.3)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x), atol=0, rtol=0)
    attn.train()
    assert not torch.equal(attn(x), attn(x))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dim": 30, "num_heads": 4}, "divisible"),
        ({"dim": 0, "num_heads": 4}, "positive"),
        ({"dim": 32, "num_heads": 4, "attn_dropout": 1.0}, "attn_dropout"),
    ],
)
def test_rejects_bad_configuration(kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SelfAttention(**kwargs)
