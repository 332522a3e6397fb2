"""model.fused_qkv: the encoder's query, key and value as one matmul (true, the default) or three
(false). Both are the same network: the same parameters from the same seed, logits, loss and every
gradient equal with padding in the batch and either pooling; the unfused path really runs three
projections of width x width where the fused one runs one of width x 3 width; a state dict, an
optimizer's state (a resume) and a Hugging Face folder written with one setting load into the
other (and the folder into transformers' own BERT) with the same logits; the shipped key."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.models.encoder import Encoder, EncoderAttention

VOCAB, CONTEXT, CLASSES, WIDTH, HEADS = 50, 32, 3, 24, 3
PAD = 0


def encoder(fused_qkv: bool, seed: int = 0, **kwargs: object) -> Encoder:
    torch.manual_seed(seed)
    shape: dict = {"layers": 2, "heads": HEADS, "width": WIDTH, "dropout": 0.0, **kwargs}
    return Encoder(VOCAB, CONTEXT, CLASSES, fused_qkv=fused_qkv, **shape)


def varied(net: Encoder, seed: int = 5) -> Encoder:
    """Weights far from BERT's small init (matrices 10x, norms and biases moved), so attention is far
    from uniform and a mix-up of q, k and v would show."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
            else:
                param.mul_(10)
    return net


def batch(lengths: tuple[int, ...] = (20, 13, 4, 1), seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
    return ids


class MatmulShapes(TorchDispatchMode):
    """The (rows, columns) of every matrix product's output, as dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm, torch.ops.aten.bmm):
            self.shapes.append(tuple(out.shape[-2:]))
        return out


@pytest.mark.parametrize("pooling", ("first", "mean"))
def test_both_layouts_are_the_same_network_in_logits_loss_and_gradients(pooling):
    fused, unfused = varied(encoder(True, pooling=pooling)), varied(encoder(False, pooling=pooling))
    assert fused.state_dict().keys() == unfused.state_dict().keys()
    for name, tensor in fused.state_dict().items():
        assert torch.equal(tensor, unfused.state_dict()[name]), name
    assert all(isinstance(block.attn, EncoderAttention) for block in unfused.blocks)
    assert [block.attn.fused_qkv for block in unfused.blocks] == [False, False]
    assert "fused_qkv=False" in repr(unfused.blocks[0].attn)
    ids, labels = batch(), torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        logits = fused.eval()(ids)
        torch.testing.assert_close(unfused.eval()(ids), logits, rtol=1e-5, atol=1e-5)
    assert logits.abs().max() > 0.5 and not torch.isnan(logits).any()  # not a trivially equal output
    losses = []
    for net in (fused.train(), unfused.train()):
        loss = F.cross_entropy(net(ids), labels)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(fused.named_parameters(), unfused.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert fused.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_the_unfused_path_runs_three_projections_where_the_fused_one_runs_one():
    ids = batch((9, 6))
    tokens = ids.numel()
    counts = {}
    for fused in (True, False):
        net = encoder(fused).eval()
        with torch.no_grad(), MatmulShapes() as seen:
            net(ids)
        counts[fused] = {"wide": seen.shapes.count((tokens, 3 * WIDTH)), "square": seen.shapes.count((tokens, WIDTH))}
    # Per block: the fused QKV (tokens x 3 width), then the attention's and the FFN's output projections
    # (tokens x width); unfused: q, k and v as three more of tokens x width.
    assert counts[True] == {"wide": 2, "square": 4}
    assert counts[False] == {"wide": 0, "square": 10}


def test_a_state_dict_and_optimizer_state_resume_in_the_other_layout():
    """Two steps with the fused layout equal one fused step, saved, then one unfused step after loading
    the network's and the optimizer's state (momentum buffers of the parameters' shapes). SGD with
    momentum, not Adam: the key's bias has a gradient of exactly zero in theory (softmax ignores a
    shift of every score), which Adam's normalisation would turn from float noise into a full step."""
    ids, labels = batch(), torch.tensor([1, 0, 2, 2])

    def step(net: Encoder, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        F.cross_entropy(net(ids), labels).backward()
        optimizer.step()

    straight = varied(encoder(True))
    optimizer = torch.optim.SGD(straight.parameters(), lr=0.1, momentum=0.9)
    step(straight, optimizer)
    saved = copy.deepcopy((straight.state_dict(), optimizer.state_dict()))  # the optimizer's state is updated in place
    step(straight, optimizer)
    resumed = encoder(False, seed=9)
    resumed.load_state_dict(saved[0])
    resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    resumed_optimizer.load_state_dict(saved[1])
    step(resumed, resumed_optimizer)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    momentum = resumed_optimizer.state_dict()["state"]
    assert all(momentum[i]["momentum_buffer"].shape == p.shape for i, p in enumerate(resumed.parameters()))
    assert not torch.equal(resumed.blocks[0].attn.qkv.weight, saved[0]["blocks.0.attn.qkv.weight"])


def test_a_folder_saved_in_either_layout_loads_in_the_other_and_in_transformers(tmp_path):
    from transformers import BertForSequenceClassification

    ids = batch()
    mask = (ids != PAD).long()
    for fused in (True, False):
        net = varied(encoder(fused, seed=3)).eval()
        folder = net.save_pretrained(tmp_path / f"fused_{fused}")
        other = Encoder(VOCAB, CONTEXT, CLASSES, pretrained=str(folder), fused_qkv=not fused, dropout=0.0).eval()
        theirs = BertForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = net(ids)
            torch.testing.assert_close(other(ids), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(theirs(input_ids=ids, attention_mask=mask).logits, expected,
                                       rtol=1e-4, atol=1e-4)


def test_the_shipped_config_says_fused_and_false_builds_the_unfused_network():
    from trainer.configuration.spec import choice_config
    from trainer.models.group import build_model, validate

    values = dict(choice_config("model", "encoder"))
    assert values["fused_qkv"] is True
    values["fused_qkv"] = False
    validate(values)
    net = build_model(values, {"num_classes": 4, "vocab_size": VOCAB, "max_positions": CONTEXT, "pad_token_id": 0},
                      required=("num_classes", "vocab_size", "max_positions"))
    assert isinstance(net, Encoder) and not any(block.attn.fused_qkv for block in net.blocks)
    assert net.eval()(batch((5, 3))).shape == (2, 4)
