"""model=encoder: a BERT-shaped encoder classifying token sequences. Logits [N, C] for any length,
unchanged by padding (and no NaN for a fully padded row); first-token (BERT's pooler) and mean
pooling; the fused QKV projection equal to BERT's three; BERT's initialisation; Hugging Face folders
both ways against transformers' own BertForSequenceClassification (our save -> their load, their save
-> our load, equal logits with padding in the batch), and the one-line refusals of a folder that does
not fit; the FLOP count against torch's counter; layer-wise lr decay from its group_matcher without
timm (and equal to timm's grouping where timm is installed); the embeddings exempt from weight decay;
torch.compile with dynamic lengths; `blocks.*` activation checkpointing; the shipped config."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers import in_forked_child
from trainer.groups.optimizer.parameters import layer_indices, layer_lr_scales, one_dimensional
from trainer.infra.errors import UserError
from trainer.measure.mfu import _meta_copy
from trainer.models.activation_checkpointing import apply_activation_checkpointing
from trainer.models.encoder import Encoder

VOCAB, CONTEXT, CLASSES, WIDTH = 40, 24, 3, 16
PAD = 0


def tiny(seed: int = 0, **kwargs: object) -> Encoder:
    torch.manual_seed(seed)
    shape: dict = {"layers": 2, "heads": 2, "width": WIDTH, **kwargs}
    return Encoder(VOCAB, CONTEXT, CLASSES, **shape)


def varied(net: Encoder) -> Encoder:
    """`net` with its norms and biases moved off their init and its matrices 10x larger (std 0.2), so that
    attention is far from uniform, logits are of order 1, and a difference shows above the tolerance."""
    with torch.no_grad():
        for param in net.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
            else:
                param.mul_(10)
    return net


def sequences(lengths: tuple[int, ...] = (16, 11, 3), seed: int = 1, pad_to: int | None = None) -> torch.Tensor:
    """[CLS] tokens [SEP] rows of the given lengths, padded with PAD to the longest (or `pad_to`)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), pad_to or max(lengths)), PAD, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(4, VOCAB, (length,), generator=generator)
        ids[row, 0], ids[row, length - 1] = 2, 3
    return ids


def hf_model(seed: int = 0, classes: int = CLASSES, **config: object):
    """transformers' own BertForSequenceClassification, randomly initialised, in eval mode."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    shape: dict = {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "intermediate_size": 4 * WIDTH, "max_position_embeddings": CONTEXT, "num_labels": classes, **config}
    model = BertForSequenceClassification(BertConfig(**shape)).eval()
    with torch.no_grad():  # LayerNorms and biases away from their init, so that a mix-up of names shows
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=(ids != PAD).long()).logits


def refusal(**kwargs: object) -> str:
    with pytest.raises(UserError) as raised:
        Encoder(kwargs.pop("vocab_size", VOCAB), kwargs.pop("max_positions", CONTEXT), kwargs.pop("num_classes", CLASSES),
                **kwargs)
    line = raised.value.line()
    assert "\n" not in line
    return line


# -- the forward contract -------------------------------------------------------------------------------
def test_logits_have_one_row_per_sequence_and_class_at_any_length():
    net = tiny().eval()
    for length in (1, 8, CONTEXT):
        logits = net(torch.randint(4, VOCAB, (5, length)))
        assert logits.shape == (5, CLASSES) and logits.dtype == torch.float32


def test_a_sequence_longer_than_max_positions_is_refused():
    with pytest.raises(ValueError, match="max_positions=24"):
        tiny()(torch.ones(1, CONTEXT + 1, dtype=torch.long))


@pytest.mark.parametrize("pooling", ("first", "mean"))
def test_padding_appended_to_a_sequence_does_not_change_its_logits(pooling):
    """One sequence alone, with 8 and 13 extra padding tokens, and beside longer ones in a batch: the
    same logits (the padded keys are masked out of every attention and out of the mean)."""
    net = varied(tiny(pooling=pooling)).eval()
    alone = sequences((7,))
    with torch.no_grad():
        reference = net(alone)
        for extra in (8, 13):
            torch.testing.assert_close(net(sequences((7,), pad_to=7 + extra)), reference)
        batch = torch.cat([sequences((7,), pad_to=CONTEXT), sequences((CONTEXT, 20), seed=5)])
        torch.testing.assert_close(net(batch)[:1], reference)
    # and the mask matters: the same padded row attended without it gives other logits
    with torch.no_grad():
        padded = sequences((7,), pad_to=16)
        unmasked = net(padded, attention_mask=torch.ones_like(padded))
    assert (unmasked - reference).abs().max() > 0.01 and reference.abs().max() > 0.1


def test_a_given_attention_mask_is_the_one_used_and_a_fully_padded_row_gives_no_nan():
    net = tiny().eval()
    ids = sequences((9, 4))
    with torch.no_grad():
        torch.testing.assert_close(net(ids, attention_mask=(ids != PAD).long()), net(ids))
        empty = torch.full((2, 8), PAD, dtype=torch.long)
        for pooling_net in (net, tiny(pooling="mean").eval()):
            assert torch.isfinite(pooling_net(empty)).all()
    loss = tiny().train()(torch.cat([sequences((8,)), torch.zeros(1, 8, dtype=torch.long)])).sum()
    loss.backward()
    assert torch.isfinite(loss)


def final_hidden(net: Encoder, ids: torch.Tensor) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    handle = net.blocks[-1].register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        net(ids)
    handle.remove()
    return captured[0]


def test_first_pooling_is_berts_pooler_and_mean_pooling_averages_the_tokens():
    """first: classifier(tanh(pooler(h[:, 0]))); mean: classifier(mean of h over the non-padded tokens).
    The two heads read different features, so their logits differ on the same weights."""
    first, mean = varied(tiny(pooling="first")).eval(), tiny(pooling="mean").eval()
    unexpected = mean.load_state_dict(first.state_dict(), strict=False).unexpected_keys
    assert unexpected == ["pooler.weight", "pooler.bias"]  # the same encoder and classifier, no pooler
    ids = sequences((10, 5))
    hidden = final_hidden(first, ids)
    assert first.pooler is not None and mean.pooler is None
    with torch.no_grad():
        expected_first = first.classifier(torch.tanh(first.pooler(hidden[:, 0])))
        torch.testing.assert_close(first(ids), expected_first)
        hidden_mean = final_hidden(mean, ids)
        averaged = torch.stack([hidden_mean[0, :10].mean(0), hidden_mean[1, :5].mean(0)])
        torch.testing.assert_close(mean(ids), mean.classifier(averaged))
        torch.testing.assert_close(hidden_mean, hidden)
        assert not torch.allclose(mean(ids), first(ids), atol=1e-3)


def test_the_fused_qkv_projection_equals_three_separate_ones():
    """One Linear(width, 3 x width) per block, laid out [q | k | v] with heads contiguous: its output is
    BERT's query, key and value projections, and the block's attention is masked multi-head attention
    over them."""
    net = tiny().eval()
    attn = net.blocks[0].attn
    assert tuple(attn.qkv.weight.shape) == (3 * WIDTH, WIDTH)
    query, key, value = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
    with torch.no_grad():
        for part, linear in zip(attn.qkv.weight.chunk(3), (query, key, value)):
            linear.weight.copy_(part)
        for part, linear in zip(attn.qkv.bias.chunk(3), (query, key, value)):
            linear.bias.copy_(part)
        x = torch.randn(2, 6, WIDTH)
        torch.testing.assert_close(attn.qkv(x), torch.cat([query(x), key(x), value(x)], dim=-1))
        keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        heads = [linear(x).view(2, 6, 2, WIDTH // 2).transpose(1, 2) for linear in (query, key, value)]
        scores = heads[0] @ heads[1].transpose(-1, -2) / (WIDTH // 2) ** 0.5
        weights = scores.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1)
        expected = attn.proj((weights @ heads[2]).transpose(1, 2).reshape(2, 6, WIDTH))
        torch.testing.assert_close(attn(x, attn_mask=keep[:, None, None, :]), expected)


def test_the_initialisation_is_berts():
    net = tiny(width=64, heads=4, ffn_width=128, seed=3)
    ffn = net.blocks[1].ffn.fc.weight
    assert ffn.std().item() == pytest.approx(0.02, rel=0.05) and abs(ffn.mean().item()) < 2e-3
    assert net.embeddings.word.weight[1:].std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(net.embeddings.word.weight[PAD], torch.zeros(64))
    for name, param in net.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name


def test_the_shape_is_described_by_transformers_bert_config():
    from transformers import BertConfig

    net = tiny(ffn_width=24, dropout=0.2)
    config = net.config
    assert isinstance(config, BertConfig)
    assert (config.vocab_size, config.max_position_embeddings, config.num_labels, config.pad_token_id) == \
        (VOCAB, CONTEXT, CLASSES, PAD)
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size, config.intermediate_size) == \
        (2, 2, WIDTH, 24)
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.2
    assert config.type_vocab_size == 1 and config.architectures == ["BertForSequenceClassification"]
    assert tiny().config.intermediate_size == 4 * WIDTH


# -- Hugging Face folders --------------------------------------------------------------------------------
def test_our_folder_loads_into_transformers_with_the_same_logits(tmp_path):
    from transformers import BertForSequenceClassification

    net = tiny(seed=4, ffn_width=24).eval()
    with torch.no_grad():
        for param in net.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    assert net.save_pretrained(tmp_path / "out") == tmp_path / "out"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"] and len(config["id2label"]) == CLASSES
    assert (config["model_type"], config["hidden_size"], config["type_vocab_size"]) == ("bert", WIDTH, 1)
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert {"bert.encoder.layer.1.attention.self.key.bias", "bert.pooler.dense.weight", "classifier.weight"} <= names
    theirs = BertForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    ids = sequences((16, 11, 3))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(theirs, ids), net(ids), atol=1e-5, rtol=0)


def test_a_transformers_folder_loads_here_with_the_same_logits(tmp_path, caplog):
    """Their save_pretrained -> model.pretrained: the folder's shape replaces the configured one (said
    in a log line), its two token types become one (the first row), and the logits are theirs."""
    theirs = hf_model(seed=5, type_vocab_size=2, intermediate_size=24)
    theirs.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="trainer"):
        ours = Encoder(VOCAB, 16, CLASSES, layers=4, heads=4, width=32, pretrained=str(tmp_path)).eval()
    assert (len(ours.blocks), ours.width, ours.config.intermediate_size, ours.max_positions) == (2, WIDTH, 24, CONTEXT)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "model.layers 4 -> 2, model.heads 4 -> 2, model.width 32 -> 16, model.ffn_width 128 -> 24" in messages
    assert "initialised fresh" not in messages
    ids = sequences((16, 11, 3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf_logits(theirs, ids), atol=1e-5, rtol=0)


def test_a_bert_model_folder_without_a_head_loads_its_encoder_and_starts_a_fresh_head(tmp_path, caplog):
    """A BertModel's folder (names without `bert.`, old `LayerNorm.gamma` spelling) gives the encoder;
    the classifier it lacks keeps its fresh initialisation, and a log line says so. A classifier of
    another class count is fresh the same way."""
    theirs = hf_model(seed=6)
    encoder = {name.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma"): tensor.contiguous()
               for name, tensor in theirs.state_dict().items() if name.startswith("bert.") and "position_ids" not in name}
    folder = tmp_path / "bert_model"
    folder.mkdir()
    save_file(encoder, str(folder / "model.safetensors"), metadata={"format": "pt"})
    theirs.config.to_json_file(folder / "config.json")
    fresh = tiny(seed=9)
    with caplog.at_level(logging.INFO, logger="trainer"):
        ours = Encoder(VOCAB, CONTEXT, CLASSES, layers=2, heads=2, width=WIDTH, pretrained=str(folder))
    assert "the classifier is initialised fresh (the folder has no classifier)" in caplog.text
    torch.testing.assert_close(ours.classifier.weight.std(), fresh.classifier.weight.std(), rtol=0.5, atol=0)
    for name in ("blocks.1.norm2.weight", "pooler.weight", "embeddings.word.weight"):
        hf_name = {"blocks.1.norm2.weight": "bert.encoder.layer.1.output.LayerNorm.weight",
                   "pooler.weight": "bert.pooler.dense.weight",
                   "embeddings.word.weight": "bert.embeddings.word_embeddings.weight"}[name]
        torch.testing.assert_close(dict(ours.named_parameters())[name], theirs.state_dict()[hf_name])

    hf_model(seed=6, classes=5).save_pretrained(tmp_path / "five")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        Encoder(VOCAB, CONTEXT, CLASSES, layers=2, heads=2, width=WIDTH, pretrained=str(tmp_path / "five"))
    assert "the classifier is initialised fresh (the folder's classifier has 5 classes, the data 3)" in caplog.text


def test_a_mean_pooled_network_saves_its_encoder_as_a_bert_model_folder(tmp_path, caplog):
    """Hugging Face's classifiers pool the first token: a mean-pooled network's folder is the encoder
    alone, which transformers' BertModel loads to the same hidden states, and model.pretrained loads
    with a fresh head."""
    from transformers import BertModel

    net = varied(tiny(pooling="mean")).eval()
    with caplog.at_level(logging.INFO, logger="trainer"):
        net.save_pretrained(tmp_path)
    assert "holds the encoder without its head" in caplog.text
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertModel"]
    ids = torch.tensor([[2, 7, 9, 11, 3, 0, 0, 0], [2, 5, 6, 7, 8, 9, 10, 3]])
    keep = ids != 0
    theirs = BertModel.from_pretrained(tmp_path, add_pooling_layer=False).eval()
    with torch.no_grad():
        hidden = theirs(input_ids=ids, attention_mask=keep.long()).last_hidden_state
        # Their hidden states, mean-pooled and put through our classifier, are our logits.
        assert torch.allclose(net.classifier(net.pool(hidden, keep)), net(ids), atol=1e-5)
    again = Encoder(VOCAB, CONTEXT, CLASSES, layers=2, heads=2, width=WIDTH, pooling="mean", pretrained=str(tmp_path))
    body = {k: v for k, v in net.state_dict().items() if not k.startswith("classifier.")}
    assert all(torch.equal(again.state_dict()[k], v) for k, v in body.items())


def test_folders_that_do_not_fit_are_refused_in_one_line(tmp_path):
    hf_model().save_pretrained(tmp_path / "bert")
    assert refusal(pretrained=str(tmp_path / "nowhere")).startswith(f"model.pretrained: '{tmp_path / 'nowhere'}' is "
                                                                    "not a folder; allowed: a local folder")
    only_bin = tmp_path / "only_bin"
    only_bin.mkdir()
    (only_bin / "config.json").write_text((tmp_path / "bert" / "config.json").read_text())
    (only_bin / "pytorch_model.bin").write_bytes(b"")
    assert "has no model.safetensors (only safetensors weights are read" in refusal(pretrained=str(only_bin))
    assert "has no config.json and no model.safetensors" in refusal(pretrained=str(tmp_path))

    line = refusal(vocab_size=50, pretrained=str(tmp_path / "bert"))
    assert line.startswith("model.pretrained: bert.embeddings.word_embeddings.weight is 40 x 16 in the folder, "
                           "this network needs 50 x 16; use the folder's tokenizer.json as data.tokenizer")
    assert "data.max_length <= 24" in refusal(max_positions=32, pretrained=str(tmp_path / "bert"))

    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    (tmp_path / "bert" / "config.json").write_text(json.dumps({**config, "model_type": "roberta"}))
    assert "describes a roberta model" in refusal(pretrained=str(tmp_path / "bert"))

    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "bert" / "model.safetensors")
    del weights["bert.encoder.layer.1.attention.self.value.weight"]
    save_file(weights, str(tmp_path / "bert" / "model.safetensors"))
    assert "has no tensor bert.encoder.layer.1.attention.self.value.weight" in refusal(pretrained=str(tmp_path / "bert"))


@pytest.mark.parametrize("kwargs, start", [
    ({"width": 30, "heads": 4}, "model.heads: model.width 30 is not divisible by 4 heads"),
    ({"layers": 0}, "model.layers: must be at least 1"),
    ({"dropout": 1.0}, "model.dropout: must be in [0, 1)"),
    ({"pooling": "max"}, "model.pooling: unknown pooling 'max'"),
    ({"pad_token_id": VOCAB}, "model.pad_token_id: 40 is not a token id below vocab_size 40"),
])
def test_a_shape_the_blocks_cannot_have_is_one_line_naming_the_key(kwargs, start):
    assert refusal(**kwargs).startswith(start)


def test_without_the_text_extra_the_model_is_one_line(monkeypatch):
    monkeypatch.setattr("trainer.infra.extras.missing_modules", lambda extra: ["transformers"])
    with pytest.raises(UserError, match=r"model=encoder: needs the 'text' extra \(transformers not installed\)"):
        tiny()


# -- what the optimizer reads ---------------------------------------------------------------------------
def test_layer_decay_scales_each_layer_by_its_depth_below_the_head_without_timm(monkeypatch):
    """Head (pooler, classifier) 1.0, the last block x decay, each block below x decay again, the
    embeddings lowest: the group_matcher's layers, grouped with timm unimportable."""
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` now raises ImportError
    net = tiny(layers=3)
    scales = layer_lr_scales(net, 0.5)
    assert scales["classifier.weight"] == scales["pooler.bias"] == 1.0
    assert scales["blocks.2.attn.qkv.weight"] == scales["blocks.2.norm2.bias"] == 0.5
    assert scales["blocks.1.ffn.fc.weight"] == 0.25 and scales["blocks.0.norm1.weight"] == 0.125
    assert scales["embeddings.word.weight"] == scales["embeddings.norm.bias"] == 0.0625
    assert set(scales) == {name for name, _ in net.named_parameters()}


def test_the_layers_are_timms_grouping_where_timm_is_installed():
    """The framework's `layer_indices` numbers the layers as timm's `group_parameters`: for the
    encoder, for a ViT (whose final norm joins the last block by timm's MATCH_PREV_GROUP) and for a
    callable matcher."""
    timm_models = pytest.importorskip("timm.models")
    import timm

    net = tiny(layers=3, pooling="mean")
    theirs = timm_models.group_parameters(net, net.group_matcher(), reverse=True)
    assert layer_indices([n for n, _ in net.named_parameters()], net.group_matcher()) == theirs
    assert max(theirs.values()) == 4
    vit = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=16, patch_size=4, depth=2, embed_dim=32,
                            num_heads=2)
    matcher = vit.group_matcher(coarse=False)
    assert layer_indices([n for n, _ in vit.named_parameters()], matcher) == \
        timm_models.group_parameters(vit, matcher, reverse=True)

    def by_depth(name: str) -> tuple[int, int]:
        return (0, 0) if name.startswith("embeddings") else (1, int(name.split(".")[1])) if name.startswith("blocks") \
            else (2, 0)
    assert layer_indices([n for n, _ in net.named_parameters()], by_depth) == \
        timm_models.group_parameters(net, by_depth, reverse=True)


def test_optimizer_layer_decay_validates_without_timm(monkeypatch):
    """The refusal that layer decay needs timm is gone from the optimizer group (model=timm keeps its own)."""
    from trainer.configuration.spec import choice_config, choice_values
    from trainer.models.group import validate as validate_model

    monkeypatch.setattr("trainer.infra.extras.missing_modules", lambda extra: ["timm"] if extra == "timm" else [])
    assert choice_config("optimizer", "adamw", layer_decay=0.75).layer_decay == 0.75
    with pytest.raises(UserError, match="model=timm: needs the 'timm' extra"):
        validate_model(dict(choice_values("model", "timm")))


def test_norms_biases_and_embeddings_are_exempt_from_weight_decay():
    net = tiny()
    exempt = one_dimensional(net)
    assert net.no_weight_decay() <= exempt
    assert {"embeddings.position.weight", "blocks.0.norm1.weight", "blocks.1.attn.qkv.bias", "classifier.bias"} <= exempt
    assert not {"blocks.0.attn.qkv.weight", "blocks.1.ffn.fc.weight", "pooler.weight", "classifier.weight"} & exempt


# -- FLOPs, compile, checkpointing ------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ("first", "mean"))
def test_the_flop_formula_agrees_with_torchs_flop_counter(pooling):
    """6N + 12 x layers x width x T + 6 N_head / T against FlopCounterMode on a meta copy (forward and
    backward of a batch of 2 at T = 16); the counter sees only matmuls, the formula no elementwise work."""
    net = tiny(layers=3, width=32, heads=4, pooling=pooling)
    flops, how = net.flops_per_token(16)
    meta = _meta_copy(net).train()
    counter = FlopCounterMode(display=False)
    with counter:
        meta(torch.full((2, 16), 5, dtype=torch.long, device="meta")).sum().backward()
    assert flops == pytest.approx(counter.get_total_flops() / (2 * 16), rel=0.03)
    assert how.startswith("6N + 12 x layers x width x T + 6 N_head / T") and "3 layers, width 32, T 16" in how


@pytest.mark.slow
def test_variable_lengths_run_compiled_with_dynamic_shapes():
    """torch.compile(dynamic=True, fullgraph=True) traces the forward with the padding mask once (no
    graph break, no branch on tensor values) and agrees with eager at two lengths (in a forked child:
    tests.helpers.in_forked_child says why)."""
    def check() -> None:
        net = tiny().eval()
        compiled = torch.compile(net, dynamic=True, fullgraph=True, backend="eager")
        for lengths in ((8, 5), (16, 16, 3)):
            ids = sequences(lengths)
            torch.testing.assert_close(compiled(ids), net(ids))

    in_forked_child(check)


def test_checkpointed_blocks_give_the_same_loss_and_gradients():
    plain, checkpointed = tiny(dropout=0.0), tiny(dropout=0.0)
    assert apply_activation_checkpointing(checkpointed, ["blocks.*"]) == ["blocks.0", "blocks.1"]
    ids, labels = sequences((12, 7)), torch.tensor([0, 2])
    losses = []
    for net in (plain, checkpointed):
        loss = F.cross_entropy(net.train()(ids), labels)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_the_shipped_config_validates_and_builds_with_the_datas_inputs():
    """conf/model/encoder.yaml passes the group's check (pad_token_id is filled from the data, not a key)
    and build_model gives it vocab_size, max_positions, pad_token_id and num_classes."""
    from trainer.configuration.spec import choice_config
    from trainer.models.group import INJECTED_MODEL_ARGS, build_model, validate

    assert "pad_token_id" in INJECTED_MODEL_ARGS
    values = choice_config("model", "encoder")
    validate(dict(values))
    net = build_model(values, {"num_classes": 5, "vocab_size": VOCAB, "max_positions": 32, "pad_token_id": 1},
                      required=("num_classes", "vocab_size", "max_positions"))
    assert isinstance(net, Encoder) and (len(net.blocks), net.width, net.config.num_attention_heads) == (2, 128, 4)
    assert net.pad_token_id == 1 and net.max_positions == 32
    assert net.eval()(sequences((8, 4))).shape == (2, 5)


def test_a_folder_written_here_loads_here_unchanged(tmp_path):
    net = tiny(seed=8).eval()
    net.save_pretrained(tmp_path)
    again = Encoder(VOCAB, CONTEXT, CLASSES, pretrained=str(Path(tmp_path))).eval()
    for (name, a), (_, b) in zip(net.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(a, b, msg=name, atol=0, rtol=0)
