"""A decoder-only Transformer language model (``model=gpt``), randomly initialised: nothing is downloaded.

Two shapes, named after the models that made them common: ``gpt2`` (learned positions, LayerNorm
with bias, GELU MLP with biases) and ``llama`` (rotary positions, RMSNorm, SwiGLU MLP, no biases).
The shape is written down as Hugging Face's own configuration class (`GPT2Config`, `LlamaConfig`),
kept as ``net.config``, so a run's model is described in the terms every LM tool reads; the
modules are this file's and `trainer.models.attention`'s, small enough to read, with one fused QKV
matmul per block and PyTorch's ``scaled_dot_product_attention`` (flash / memory-efficient kernels).

Also here, because they only make sense for this network: the training FLOPs per token by the PaLM
formula (`transformer_flops_per_token`), and autoregressive sampling (`generate`, with a KV cache)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.infra.errors import UserError
from trainer.infra.extras import require
from trainer.infra.schema import AT_LEAST_ONE, Doc, Range
from trainer.models.attention import SelfAttention
from trainer.models.layers import GeluMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Style = Literal["gpt2", "llama"]
#: Rotary base frequency: the default of LlamaConfig (as rope_theta, or rope_parameters from transformers 5).
ROPE_THETA = 10000.0
#: GPT-2's initialisation: every weight N(0, 0.02); residual output projections further scaled.
INIT_STD = 0.02
NORM_EPS = 1e-5


class GPT(nn.Module):
    """Token ids ``[B, T]`` -> next-token logits ``[B, T, vocab_size]``, causal: the logits at
    position t see tokens 0..t only. T may be anything from 1 to `max_positions` and change between
    calls (bucketed batches, `torch.compile(dynamic=True)`): nothing branches on tensor values.

    `vocab_size` and `max_positions` come from the data (its tokenizer and sequence length)."""

    def __init__(
        self,
        vocab_size: int,
        max_positions: int,
        style: Annotated[Style, Doc("gpt2: learned positions, LayerNorm, GELU MLP, biases; llama: rotary "
                                    "positions, RMSNorm, SwiGLU MLP, no biases")] = "gpt2",
        layers: Annotated[int, AT_LEAST_ONE, Doc("Transformer blocks")] = 4,
        heads: Annotated[int, AT_LEAST_ONE, Doc("attention heads per block (width must be divisible by it)")] = 4,
        width: Annotated[int, AT_LEAST_ONE, Doc("channels of the residual stream (d_model)")] = 128,
        ffn_width: Annotated[Optional[int], Range(ge=1), Doc("hidden channels of each block's MLP; null: 4 x width "
                                                             "(gpt2), 8/3 x width rounded up to 64 (llama)")] = None,
        dropout: Annotated[float, Range(ge=0, lt=1), Doc("dropout on the embeddings, the attention weights and "
                                                         "each residual branch")] = 0.0,
        tie_embeddings: Annotated[bool, Doc("the output head shares the token embedding's weight")] = True,
    ) -> None:
        super().__init__()
        _check_shape(vocab_size, max_positions, style, layers, heads, width, dropout)
        self.style: Style = style
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.width, self.heads, self.head_dim = width, heads, width // heads
        self.ffn_width = ffn_width or default_ffn_width(style, width)
        self.config = hf_config(self, layers, dropout, tie_embeddings)

        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_positions, width) if style == "gpt2" else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(style, width, heads, self.ffn_width, dropout) for _ in range(layers))
        self.ln_f = _norm(style, width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self._init_weights(layers)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self, layers: int) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, and the projections that write into the residual
        stream scaled by 1/sqrt(2 x layers) (two per block), so the stream's variance does not grow
        with depth."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = INIT_STD / math.sqrt(2 * layers) if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def no_weight_decay(self) -> set[str]:
        """The embeddings, exempt from weight decay by the optimizer's rule
        (`trainer.groups.optimizer.parameters.named_by_model`): it exempts only 1-D parameters
        by itself, and an embedding table is 2-D. With tied embeddings this is the head's weight too."""
        return {"embed.weight", "pos.weight"} if self.pos is not None else {"embed.weight"}

    def flops_per_token(self, sequence_length: int) -> tuple[int, str]:
        """Training FLOPs per token and how: `transformer_flops_per_token` (the language-model task
        asks the network for its own count before falling back to the FLOP counter)."""
        return transformer_flops_per_token(self, sequence_length)

    def forward(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """`cache`: the keys and values of the tokens before these (generation, `KVCache`): these
        tokens take the positions after them, attend to them and are added to them."""
        tokens = input_ids.shape[-1]
        start = cache.length if cache is not None else 0
        if start + tokens > self.max_positions:  # a shape, not a tensor value: a guard under torch.compile
            raise ValueError(f"{start + tokens} tokens, more than max_positions={self.max_positions}")
        x = self.embed(input_ids)
        positions = torch.arange(start, start + tokens, device=input_ids.device)
        if self.pos is not None:
            x = x + self.pos(positions)
        rotary = rotary_angles(positions, self.head_dim) if self.style == "llama" else None
        x = self.drop(x)
        for index, block in enumerate(self.blocks):
            x = block(x, rotary, None if cache is None else (cache, index))
        if cache is not None:
            cache.length += tokens
        return self.head(self.ln_f(x))


class KVCache:
    """The keys and values every block computed for the `length` tokens seen so far, so that a new
    token costs one position's work instead of a forward over the whole context (generation).
    Preallocated for `max_positions` tokens of `batch` sequences in the network's dtype and device."""

    def __init__(self, net: GPT, batch: int) -> None:
        weight = net.head.weight
        shape = (batch, net.heads, net.max_positions, net.head_dim)
        self.keys = [torch.empty(shape, dtype=weight.dtype, device=weight.device) for _ in net.blocks]
        self.values = [torch.empty(shape, dtype=weight.dtype, device=weight.device) for _ in net.blocks]
        self.capacity = net.max_positions
        self.length = 0

    def extend(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `index`'s keys and values with `k`, `v` ``[B, heads, T, head_dim]`` (the tokens after
        the `length` held) written after them: views of everything held so far."""
        end = self.length + k.shape[2]
        self.keys[index][:, :, self.length:end] = k
        self.values[index][:, :, self.length:end] = v
        return self.keys[index][:, :, :end], self.values[index][:, :, :end]


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, style: Style, width: int, heads: int, ffn_width: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = _norm(style, width)
        self.attn = CausalSelfAttention(width, heads, bias=style == "gpt2", dropout=dropout)
        self.ln_2 = _norm(style, width)
        self.mlp: GeluMLP | SwiGLU = (GeluMLP(width, ffn_width, dropout, approximate="tanh") if style == "gpt2"
                                      else SwiGLU(width, ffn_width, dropout))

    def forward(self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                cache: Optional[tuple[KVCache, int]] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rotary, cache)
        return x + self.mlp(self.ln_2(x))


class CausalSelfAttention(SelfAttention):
    """`SelfAttention` (one fused QKV Linear, ``[q | k | v]``), causal; rotary angles, when given, turn
    q and k, and a `KVCache`, when given, holds the keys and values of the tokens before these."""

    def __init__(self, width: int, heads: int, bias: bool, dropout: float) -> None:
        super().__init__(width, heads, qkv_bias=bias, attn_dropout=dropout, proj_dropout=dropout, proj_bias=bias)

    def forward(  # type: ignore[override]  # rotary angles and a KV cache instead of SelfAttention's mask
        self, x: torch.Tensor, rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[tuple[KVCache, int]] = None,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        mask, causal = None, True
        if cache is not None:
            held, tokens = cache[0].length, q.shape[2]
            k, v = cache[0].extend(cache[1], k, v)
            if held:  # each new token sees every token held, and the new ones up to itself
                causal = False
                if tokens > 1:
                    mask = torch.ones(tokens, held + tokens, dtype=torch.bool, device=q.device).tril(diagonal=held)
        return self.attend(q, k, v, mask, causal)


class SwiGLU(nn.Module):
    """Llama's MLP: silu(gate) x up, then down (Shazeer 2020). Gate and up are one fused Linear
    (``width -> 2 x hidden``, ``[gate | up]``): one matmul reads the input once. No biases."""

    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.proj = nn.Linear(hidden, width, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.drop(self.proj(F.silu(gate) * up))


# -- rotary positions (Su et al. 2021, RoFormer), in the "rotate half" layout of Hugging Face's Llama --
def rotary_angles(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, head_dim]`` for `positions`, in fp32 from the positions themselves: no
    table to keep, so nothing to lose when the network is cast to bf16, and any T works."""
    frequencies = ROPE_THETA ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.float(), frequencies)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x_i, x_{i + head_dim/2}) of `x` ``[B, heads, T, head_dim]`` by its angle; in
    x's dtype (under autocast q and k are bf16, and SDPA wants q, k and v alike)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype)


# -- the shape -----------------------------------------------------------------------------------------
def default_ffn_width(style: Style, width: int) -> int:
    """4 x width for GPT-2; for SwiGLU, 8/3 x width rounded up to a multiple of 64, as Llama sizes it: its
    three matrices then hold about the parameters of GPT-2's two."""
    if style == "gpt2":
        return 4 * width
    return 64 * math.ceil(8 * width / 3 / 64)


def _check_shape(vocab_size: int, max_positions: int, style: str, layers: int, heads: int, width: int,
                 dropout: float) -> None:
    """The one-line refusals of a shape the blocks cannot have."""
    if style not in ("gpt2", "llama"):
        raise UserError("model.style", f"unknown style '{style}'", "gpt2, llama")
    for key, value in (("vocab_size", vocab_size), ("max_positions", max_positions), ("layers", layers),
                       ("heads", heads), ("width", width)):
        if value < 1:
            raise UserError(f"model.{key}", f"must be at least 1, got {value}")
    if width % heads:
        raise UserError("model.heads", f"model.width {width} is not divisible by {heads} heads",
                        "a head count that divides model.width")
    if style == "llama" and (width // heads) % 2:
        raise UserError("model.heads", f"rotary positions need an even head dimension; model.width {width} / "
                        f"{heads} heads = {width // heads}", "model.width / model.heads even")
    if not 0 <= dropout < 1:
        raise UserError("model.dropout", f"must be in [0, 1), got {dropout}")


def hf_config(net: GPT, layers: int, dropout: float, tie_embeddings: bool) -> PretrainedConfig:
    """The network's shape as transformers' own configuration class (its modules are not used). The
    special tokens are the tokenizer's business (its tokenizer.json): the classes' defaults (GPT-2's
    50256, Llama's 1 and 2) would name ids of another vocabulary."""
    require("text", "model=gpt")
    from transformers import GPT2Config, LlamaConfig

    shared: dict[str, Any] = {"vocab_size": net.vocab_size, "initializer_range": INIT_STD,
                              "tie_word_embeddings": tie_embeddings, "bos_token_id": None, "eos_token_id": None,
                              "pad_token_id": None}
    if net.style == "gpt2":
        return GPT2Config(n_positions=net.max_positions, n_embd=net.width, n_layer=layers, n_head=net.heads,
                          n_inner=net.ffn_width, activation_function="gelu_new", resid_pdrop=dropout,
                          embd_pdrop=dropout, attn_pdrop=dropout, layer_norm_epsilon=NORM_EPS, **shared)
    return LlamaConfig(max_position_embeddings=net.max_positions, hidden_size=net.width, num_hidden_layers=layers,
                       num_attention_heads=net.heads, num_key_value_heads=net.heads, intermediate_size=net.ffn_width,
                       hidden_act="silu", rms_norm_eps=NORM_EPS, attention_dropout=dropout, attention_bias=False,
                       mlp_bias=False, **shared)


def _norm(style: Style, width: int) -> nn.Module:
    return nn.LayerNorm(width, eps=NORM_EPS) if style == "gpt2" else nn.RMSNorm(width, eps=NORM_EPS)


# -- what the framework derives from it ----------------------------------------------------------------
def matmul_parameters(net: GPT) -> int:
    """N of the FLOP formula: the weights that multiply activations. Every Linear weight of the
    blocks, and the output head (vocab x width, once even when tied to the embedding); not the
    embedding lookups (a gather, not a matmul), norms or biases."""
    blocks = sum(m.weight.numel() for m in net.blocks.modules() if isinstance(m, nn.Linear))
    return blocks + net.head.weight.numel()


def transformer_flops_per_token(net: GPT, sequence_length: int) -> tuple[int, str]:
    """Training FLOPs (forward + backward) per token, and how they were derived: 6N for the matmuls
    (2 forward, 4 backward per weight) plus 12 x layers x width x T for the attention scores and the
    weighted sum of values (PaLM, Chowdhery et al. 2022, appendix B). As in PaLM, the half of the
    scores the causal mask discards is not subtracted: the kernels' real savings vary."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be at least 1, got {sequence_length}")
    net = getattr(net, "_orig_mod", net)  # a torch.compile wrapper: the eager model
    n, layers = matmul_parameters(net), len(net.blocks)
    flops = 6 * n + 12 * layers * net.width * sequence_length
    return flops, (f"6N + 12 x layers x width x T (PaLM, Chowdhery et al. 2022, app. B): N = {n:,} matmul "
                   f"parameters, {layers} layers, width {net.width}, T {sequence_length}")


@torch.no_grad()
def generate(net: GPT, ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, greedy: bool = False,
             generator: Optional[torch.Generator] = None, cache: bool = True,
             stop_token: Optional[int] = None) -> torch.Tensor:
    """`ids` ``[B, t]`` followed by up to `max_new_tokens` tokens, each predicted from the context's
    last `max_positions` tokens. `cache` keeps the context's keys and values (`KVCache`): a new token
    costs one position's work until the context fills `max_positions`, then every position shifts and
    the window runs again; the same tokens as without it (to rounding; tested). `greedy`: the most
    likely token; otherwise the logits divided by `temperature`, all but the `top_k` most likely
    dropped, sampled with `generator`. A sequence that samples `stop_token` is done (its later
    positions filled with it); generation stops once all are. Runs in eval mode, then restores the mode."""
    _check_sampling(ids, max_new_tokens, temperature, top_k)
    was_training = net.training
    net.eval()
    try:
        step = _cached_steps(net, ids) if cache else _uncached_steps(net)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            token = next_token(step(ids).float(), temperature, top_k, greedy, generator)
            if stop_token is not None:
                token = token.masked_fill(done.unsqueeze(1), stop_token)
                done |= token.squeeze(1) == stop_token
            ids = torch.cat((ids, token), dim=1)
            if stop_token is not None and bool(done.all()):
                break
    finally:
        net.train(was_training)
    return ids


def _uncached_steps(net: GPT) -> Callable[[torch.Tensor], torch.Tensor]:
    """Next-token logits ``[B, vocab]`` of a context: its last `max_positions` tokens run again."""
    return lambda ids: net(ids[:, -net.max_positions:])[:, -1, :]


def _cached_steps(net: GPT, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """As `_uncached_steps`, keeping the keys and values: the first call runs the context's window,
    each later one the token added since, until the window is full (then the window again)."""
    kv = KVCache(net, ids.shape[0])

    def step(context: torch.Tensor) -> torch.Tensor:
        if kv.length == 0 or kv.length == kv.capacity:
            kv.length = 0
            return net(context[:, -net.max_positions:], kv)[:, -1, :]
        return net(context[:, -1:], kv)[:, -1, :]

    return step


def next_token(logits: torch.Tensor, temperature: float, top_k: Optional[int], greedy: bool,
               generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token ``[B, 1]`` from last-position logits ``[B, vocab]``."""
    if greedy:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def _check_sampling(ids: torch.Tensor, max_new_tokens: int, temperature: float, top_k: Optional[int]) -> None:
    if ids.ndim != 2 or ids.shape[1] < 1 or ids.dtype != torch.long:
        raise ValueError(f"ids must be a LongTensor [batch, tokens] with at least one token, got "
                         f"{ids.dtype} {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be greater than 0, got {temperature} (for the most likely token "
                         "every step, use greedy=True)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or None: every token), got {top_k}")

