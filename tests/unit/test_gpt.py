"""model=gpt: a decoder-only Transformer in two styles (gpt2, llama), causal, with tied embeddings,
one fused QKV matmul per block, training on a pattern, any sequence length (eager, compiled with
dynamic shapes, torch.export); its PaLM FLOP formula against torch's FLOP counter; greedy and
sampled generation, with the KV cache giving the uncached path's tokens, and the stop token; `blocks.*` activation checkpointing; and the one-line refusals of a bad shape."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import in_forked_child
from trainer.groups.optimizer.parameters import one_dimensional
from trainer.infra.errors import UserError
from trainer.measure.mfu import _meta_copy
from trainer.models.activation_checkpointing import apply_activation_checkpointing, select_stages
from trainer.models.gpt import (GPT, Block, KVCache, Style, SwiGLU, default_ffn_width, generate, matmul_parameters,
                                transformer_flops_per_token)

STYLES = ("gpt2", "llama")
VOCAB, CONTEXT = 37, 16


def tiny(style: Style = "gpt2", seed: int = 0, **kwargs: object) -> GPT:
    torch.manual_seed(seed)
    shape: dict = {"layers": 2, "heads": 2, "width": 16, **kwargs}
    return GPT(VOCAB, CONTEXT, style=style, **shape)


def blocks(net: GPT) -> list[Block]:
    return [cast(Block, block) for block in net.blocks]


def tokens(batch: int = 2, length: int = CONTEXT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def lm_loss(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = net(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


# -- the forward contract -------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_logits_have_one_row_per_token_and_vocabulary_entry(style):
    """[B, T] ids -> [B, T, vocab] float logits, for any T from 1 to max_positions."""
    net = tiny(style)
    for length in (1, 5, CONTEXT):
        assert net(tokens(3, length)).shape == (3, length, VOCAB)


def test_a_sequence_longer_than_max_positions_is_refused():
    """More tokens than max_positions is a ValueError naming the limit, not an index error deep inside."""
    with pytest.raises(ValueError, match="max_positions=16"):
        tiny()(tokens(1, CONTEXT + 1))


@pytest.mark.parametrize("style", STYLES)
def test_the_model_is_causal(style):
    """Changing the tokens after position t leaves the logits at positions 0..t unchanged."""
    net = tiny(style).eval()
    ids = tokens(2, 12)
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % VOCAB
    before, after = net(ids), net(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("style", STYLES)
def test_variable_lengths_work_eagerly_and_compiled_with_dynamic_shapes(style):
    """Bucketed batches change T between calls: torch.compile(dynamic=True, fullgraph=True) traces the
    whole forward once (no graph break, no branch on tensor values) and agrees with eager at each T.
    The eager backend keeps the test fast; what it checks is the trace, not the kernels. Traced in a
    forked child (tests.helpers.in_forked_child says why)."""
    def check() -> None:
        net = tiny(style).eval()
        compiled = torch.compile(net, dynamic=True, fullgraph=True, backend="eager")
        for length in (3, 9, CONTEXT):
            ids = tokens(2, length)
            torch.testing.assert_close(compiled(ids), net(ids))

    in_forked_child(check)


@pytest.mark.parametrize("style", STYLES)
def test_torch_export_matches_eager_logits(style):
    """torch.export.export traces the network, at a fixed length and with a dynamic one (in a forked
    child: tests.helpers.in_forked_child says why)."""
    def check() -> None:
        net = tiny(style).eval()
        ids = tokens(2, 8)
        with torch.no_grad():
            program = torch.export.export(net, (ids,))
            torch.testing.assert_close(program.module()(ids), net(ids))
            length = torch.export.Dim("tokens", min=2, max=CONTEXT)
            dynamic = torch.export.export(net, (ids,), dynamic_shapes=({1: length},))
            torch.testing.assert_close(dynamic.module()(tokens(2, 13)), net(tokens(2, 13)))

    in_forked_child(check)


# -- the structure --------------------------------------------------------------------------------------
def test_tied_embeddings_are_one_tensor_and_untied_are_two():
    """tie_embeddings=True: the head's weight IS the embedding's (one parameter, counted once);
    False: two separate tensors."""
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == VOCAB * 16


@pytest.mark.parametrize("style", STYLES)
def test_each_block_has_one_fused_qkv_linear(style):
    """Q, K and V come from one Linear(width, 3 x width) per block; llama's gate and up are one Linear too."""
    net = tiny(style)
    assert len(net.blocks) == 2
    for block in blocks(net):
        attention_linears = [m for m in block.attn.modules() if isinstance(m, nn.Linear)]
        assert [tuple(m.weight.shape) for m in attention_linears] == [(48, 16), (16, 16)]
        assert (block.attn.qkv.bias is not None) == (style == "gpt2")
    if style == "llama":
        hidden = default_ffn_width("llama", 16)
        assert tuple(cast(SwiGLU, blocks(net)[0].mlp).gate_up.weight.shape) == (2 * hidden, 16)
        assert isinstance(blocks(net)[0].ln_1, nn.RMSNorm) and net.pos is None
    else:
        assert isinstance(blocks(net)[0].ln_1, nn.LayerNorm) and net.pos is not None


@pytest.mark.parametrize("style", STYLES)
def test_norms_biases_and_embeddings_are_exempt_from_weight_decay(style):
    """The optimizer's rule exempts 1-D parameters and the model's no_weight_decay(): every norm,
    bias and embedding table (the tied head with it), and no Linear weight of a block."""
    net = tiny(style, tie_embeddings=False)
    exempt = one_dimensional(net)
    names = dict(net.named_parameters())
    expected = {n for n, p in names.items() if p.ndim == 1} | {"embed.weight"} | ({"pos.weight"} if style == "gpt2" else set())
    assert exempt == expected
    assert "head.weight" not in exempt and "blocks.0.attn.qkv.weight" not in exempt


def test_residual_projections_start_smaller():
    """GPT-2's init: weights N(0, 0.02), the residual output projections scaled by 1/sqrt(2 x layers)."""
    net = tiny(layers=8, width=64, heads=4)
    assert blocks(net)[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert blocks(net)[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)


@pytest.mark.parametrize("style", STYLES)
def test_the_shape_is_described_by_the_transformers_configuration_class(style):
    """net.config is GPT2Config / LlamaConfig with the network's shape, serialisable as JSON."""
    net = tiny(style, ffn_width=40, dropout=0.1)
    config = net.config.to_dict()
    assert config["model_type"] == style
    if style == "gpt2":
        assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_inner"], config["n_positions"]) \
            == (2, 2, 16, 40, CONTEXT)
    else:
        assert (config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"],
                config["intermediate_size"], config["max_position_embeddings"]) == (2, 2, 16, 40, CONTEXT)
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is True
    assert net.config.to_json_string()


# -- training -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
def test_the_loss_falls_on_a_repeated_pattern(style):
    """Forty AdamW steps on a repeated 5-token pattern take the next-token loss well below its start."""
    net = tiny(style, dropout=0.1).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ids = torch.tensor([3, 1, 4, 1, 5] * 4).unsqueeze(0).repeat(4, 1)[:, :CONTEXT]
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = lm_loss(net, ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


# -- FLOPs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("tie", (True, False))
def test_the_palm_formula_agrees_with_torchs_flop_counter(style, tie):
    """6N + 12 x layers x width x T against FlopCounterMode on a meta copy (forward + backward).
    They may differ by a few percent: the counter sees only matmuls, and how it counts SDPA depends
    on the kernel (on the meta device the math path's two bmm are the formula's 12 x L x W x T);
    elementwise work (norms, softmax, GELU) is in neither. The first block still needs its input
    gradient (the embedding learns), so the formula's 4N backward holds everywhere."""
    net = tiny(style, layers=3, width=32, heads=4, tie_embeddings=tie)
    flops, how = transformer_flops_per_token(net, CONTEXT)
    meta = _meta_copy(net).train()
    counter = FlopCounterMode(display=False)
    with counter:
        meta(torch.zeros(2, CONTEXT, dtype=torch.long, device="meta")).sum().backward()
    counted = counter.get_total_flops() / (2 * CONTEXT)
    assert flops == pytest.approx(counted, rel=0.03)
    assert how.startswith("6N + 12 x layers x width x T") and f"N = {matmul_parameters(net):,}" in how
    assert net.flops_per_token(CONTEXT) == (flops, how)  # what the language-model task asks the network


def test_n_counts_block_linears_and_the_head_once():
    """N: every Linear weight of the blocks plus vocab x width for the head; no embedding, norm or bias."""
    net = tiny("gpt2", ffn_width=24)
    per_block = 48 * 16 + 16 * 16 + 24 * 16 + 16 * 24
    assert matmul_parameters(net) == 2 * per_block + VOCAB * 16
    assert matmul_parameters(tiny("gpt2", ffn_width=24, tie_embeddings=False)) == matmul_parameters(net)


# -- generation -----------------------------------------------------------------------------------------
def test_greedy_generation_is_deterministic_and_runs_past_max_positions():
    """Greedy twice gives the same tokens; the prompt is kept; generating beyond max_positions works
    (the context is cropped to the last max_positions tokens); the network is left in its mode."""
    net = tiny().train()
    prompt = tokens(1, 5)
    first = generate(net, prompt, CONTEXT + 4, greedy=True)
    assert first.shape == (1, 5 + CONTEXT + 4)
    assert torch.equal(first[:, :5], prompt)
    assert torch.equal(first, generate(net, prompt, CONTEXT + 4, greedy=True))
    assert net.training
    long_prompt = tokens(1, CONTEXT + 3)
    assert generate(net, long_prompt, 2, greedy=True).shape == (1, CONTEXT + 5)


def test_sampling_follows_its_generator_and_top_k_one_is_greedy():
    """The same generator seed samples the same tokens; top_k=1 leaves only the most likely token."""
    net = tiny("llama")
    prompt = tokens(1, 3)
    a = generate(net, prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(7))
    b = generate(net, prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    top1 = generate(net, prompt, 8, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top1, generate(net, prompt, 8, greedy=True))


@pytest.mark.parametrize("style", STYLES)
def test_the_cache_gives_each_position_the_logits_of_a_full_forward(style):
    # The keys and values kept (KVCache): a token run after those held (one at a time, or several
    # at once under the offset causal mask) gets the logits the whole sequence's forward gives it.
    net = tiny(style).eval()
    ids = tokens(2, CONTEXT)
    full = net(ids)
    kv = KVCache(net, 2)
    pieces = [net(ids[:, :5], kv)] + [net(ids[:, t:t + 1], kv) for t in range(5, 9)] + [net(ids[:, 9:], kv)]
    assert kv.length == CONTEXT
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="more than max_positions"):
        net(ids[:, :1], kv)


@pytest.mark.parametrize("style", STYLES)
def test_generation_with_the_cache_gives_the_tokens_without_it_one_position_a_token(style):
    # Greedy and sampled, a batch of two, a short prompt generating past max_positions and a prompt
    # longer than it: the same tokens with the cache as without. With it each new token runs one
    # position until the window is full, then the window again (every position shifts).
    net = tiny(style)
    for prompt in (tokens(2, 5), tokens(2, CONTEXT + 3)):
        cached = generate(net, prompt, CONTEXT + 4, greedy=True)
        assert torch.equal(cached, generate(net, prompt, CONTEXT + 4, greedy=True, cache=False))
        sampled = generate(net, prompt, 12, temperature=1.3, top_k=5, generator=torch.Generator().manual_seed(4))
        assert torch.equal(sampled, generate(net, prompt, 12, temperature=1.3, top_k=5, cache=False,
                                             generator=torch.Generator().manual_seed(4)))
    lengths: list[int] = []
    hook = net.embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    generate(net, tokens(1, 5), CONTEXT - 2, greedy=True)
    hook.remove()
    # 5 prompt tokens, then one a token until 16 are held (11 tokens); then the window of 16 for each
    # of the last 2.
    assert lengths == [5] + [1] * (CONTEXT - 5) + [CONTEXT] * 2


def test_generation_stops_at_the_stop_token_and_pads_a_finished_sequence_with_it():
    net = tiny()
    prompt = tokens(2, 4)
    free = generate(net, prompt, 10, greedy=True)
    stop = int(free[0, 4 + 2])  # the first sequence's third new token
    stopped = generate(net, prompt, 10, greedy=True, stop_token=stop)
    first_stop = [int((row[4:] == stop).nonzero()[0]) if (row[4:] == stop).any() else None for row in free]
    assert first_stop[0] is not None and first_stop[0] <= 2
    if first_stop[1] is None:  # the second never samples it: all 10 tokens, the first padded after its stop
        assert stopped.shape == (2, 14) and torch.equal(stopped[1], free[1])
        assert torch.equal(stopped[0, :5 + first_stop[0]], free[0, :5 + first_stop[0]])
        assert (stopped[0, 5 + first_stop[0]:] == stop).all()
    else:  # both stop: generation ends at the later stop
        assert stopped.shape[1] == 4 + max(first_stop) + 1
    single = generate(net, prompt[:1], 10, greedy=True, stop_token=stop)
    assert single.shape[1] == 4 + first_stop[0] + 1 and int(single[0, -1]) == stop
    assert generate(net, prompt, 0, greedy=True).shape == (2, 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0}, "temperature must be greater than 0"),
    ({"temperature": -1.0}, "temperature must be greater than 0"),
    ({"top_k": 0}, "top_k must be at least 1"),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
])
def test_bad_sampling_settings_are_value_errors(kwargs, message):
    """temperature <= 0, top_k < 1 and a negative token count are refused with a message saying why."""
    arguments = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(tiny(), tokens(1, 3), **arguments)


# -- activation checkpointing ---------------------------------------------------------------------------
def test_blocks_star_names_every_block_in_order():
    """`blocks.*` stands for each direct child of `blocks`; plain names are untouched; repeats go."""
    net = tiny(layers=3)
    assert select_stages(net, ["blocks.*"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert select_stages(net, ["blocks.1", "blocks.*"]) == ["blocks.1", "blocks.0", "blocks.2"]
    assert select_stages(net, ["ln_f"]) == ["ln_f"]


def test_wildcard_mistakes_are_one_line_naming_what_exists():
    """An unknown `x.*` names the model's stages; a parent without children and a wildcard nested in a
    checkpointed stage are refused in one line too."""
    net = tiny()
    with pytest.raises(UserError) as raised:
        select_stages(net, ["layers.*"])
    line = raised.value.line()
    assert line.startswith("model.activation_checkpointing: no submodule named 'layers' (in 'layers.*')")
    assert "blocks.0" in line and "\n" not in line
    with pytest.raises(UserError, match="'ln_f' has no submodules"):
        select_stages(net, ["ln_f.*"])
    with pytest.raises(UserError, match="'blocks.0' is inside 'blocks'"):
        select_stages(net, ["blocks", "blocks.*"])


@pytest.mark.parametrize("style", STYLES)
def test_checkpointed_blocks_give_the_same_loss_and_gradients(style):
    """model.activation_checkpointing=[blocks.*] recomputes each block in backward: same loss, same
    gradients as the plain network (dropout 0), and every block is checkpointed."""
    plain, checkpointed = tiny(style), tiny(style)
    assert apply_activation_checkpointing(checkpointed, ["blocks.*"]) == ["blocks.0", "blocks.1"]
    ids = tokens(2, 12)
    losses = []
    for net in (plain, checkpointed):
        net.train()
        loss = lm_loss(net, ids)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


# -- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, start", [
    ({"width": 30, "heads": 4}, "model.heads: model.width 30 is not divisible by 4 heads"),
    ({"style": "llama", "width": 12, "heads": 4}, "model.heads: rotary positions need an even head dimension"),
    ({"layers": 0}, "model.layers: must be at least 1"),
    ({"dropout": 1.0}, "model.dropout: must be in [0, 1)"),
    ({"style": "bert"}, "model.style: unknown style 'bert'"),
])
def test_a_shape_the_blocks_cannot_have_is_one_line_naming_the_key(kwargs, start):
    """Impossible shapes are UserErrors naming the model key, in one line."""
    with pytest.raises(UserError) as raised:
        tiny(**kwargs)
    assert raised.value.line().startswith(start) and "\n" not in raised.value.line()


def test_without_the_text_extra_the_model_is_one_line(monkeypatch):
    """model=gpt needs transformers (its configuration classes): missing, it is one line with the pip command."""
    monkeypatch.setattr("trainer.infra.extras.missing_modules", lambda extra: ["transformers"])
    with pytest.raises(UserError, match=r"model=gpt: needs the 'text' extra \(transformers not installed\)"):
        tiny()


@pytest.mark.parametrize("choice", ("gpt", "gpt_small"))
def test_the_shipped_configs_validate_and_build(choice):
    """conf/model/gpt.yaml and gpt_small.yaml pass the model group's check against the constructor, and
    build_model fills in vocab_size and max_positions from the data."""
    from trainer.configuration.spec import choice_config
    from trainer.models.group import build_model, validate

    values = choice_config("model", choice)
    validate(dict(values))
    if choice == "gpt":
        net = build_model(values, {"vocab_size": VOCAB, "max_positions": CONTEXT},
                          required=("vocab_size", "max_positions"))
        assert isinstance(net, GPT) and net(tokens(1, 4)).shape == (1, 4, VOCAB)
