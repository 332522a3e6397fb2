"""A BERT-shaped Transformer encoder with a sequence classification head (``model=encoder``).

Token ids ``[N, L]`` -> logits ``[N, num_classes]``. The blocks are BERT's (Devlin et al. 2019):
post-LayerNorm, GELU feed-forward, learned positions and one token type; each block's attention is
`trainer.models.attention.SelfAttention` (one fused QKV Linear, PyTorch's
``scaled_dot_product_attention``) with the key-padding mask ``ids != pad_token_id``;
``model.fused_qkv=false`` computes q, k and v as three matmuls instead, from the same parameters
(`EncoderAttention`: what the fused projection buys is measured by benchmarks/encoder_kernels.py). The shape is
kept as transformers' `BertConfig` (``net.config``, the configuration class only: the modules are
this file's), so that the network reads and writes Hugging Face's BERT folders
(`save_pretrained`, ``model.pretrained=DIR``): a folder written here loads into transformers'
``BertForSequenceClassification.from_pretrained(DIR)`` with the same logits, and one it wrote loads
here. Only local safetensors folders are read; nothing is downloaded.

``model.pretrained=DIR``: the folder's config.json decides the shape (layers, heads, width,
ffn_width, the activation, the norm's epsilon, the size of the position table); a shape key given
with another value is overridden, and a log line says which (the keys always have values in
conf/model/encoder.yaml, so a refusal would refuse every run that did not repeat the folder's
shape). ``model.dropout`` and ``model.pooling`` stay the run's: they are fine-tuning choices."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trainer.infra.errors import UserError
from trainer.infra.extras import require
from trainer.infra.schema import AT_LEAST_ONE, Doc, Range
from trainer.models.attention import SelfAttention
from trainer.models.layers import GeluMLP

if TYPE_CHECKING:
    from transformers import BertConfig

log = logging.getLogger("trainer")

Pooling = Literal["first", "mean"]
#: BERT's initialisation: N(0, 0.02) (BertConfig's initializer_range).
INIT_STD = 0.02
#: BERT's LayerNorm epsilon (BertConfig's default).
NORM_EPS = 1e-12
#: Hugging Face's names of the activations a BERT folder may declare, and the module that computes each.
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
QKV = ("query", "key", "value")
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


class Encoder(nn.Module):
    """Token ids ``[N, L]`` (padded with `pad_token_id`) -> class logits ``[N, num_classes]``.

    L may be anything from 1 to `max_positions` and change between calls (`torch.compile(dynamic=True)`:
    nothing branches on tensor values). Padding never changes a sequence's logits: padded keys are
    masked out of every attention and out of the mean, and a fully padded row attends to every
    position instead of none (SDPA would give NaN). `vocab_size`, `max_positions` and `pad_token_id`
    come from the data, `num_classes` from its labels."""

    def __init__(
        self,
        vocab_size: int,
        max_positions: int,
        num_classes: int,
        pad_token_id: int = 0,
        layers: Annotated[int, AT_LEAST_ONE, Doc("Transformer blocks (with pretrained: the folder's)")] = 2,
        heads: Annotated[int, AT_LEAST_ONE, Doc("attention heads per block, dividing width (with pretrained: the "
                                                "folder's)")] = 4,
        width: Annotated[int, AT_LEAST_ONE, Doc("channels of the residual stream (hidden_size; with pretrained: "
                                                "the folder's)")] = 128,
        ffn_width: Annotated[Optional[int], Range(ge=1), Doc("hidden channels of each block's feed-forward; null: "
                                                             "4 x width (with pretrained: the folder's)")] = None,
        dropout: Annotated[float, Range(ge=0, lt=1), Doc("dropout on the embeddings, the attention weights, each "
                                                         "residual branch and before the classifier")] = 0.1,
        pooling: Annotated[Pooling, Doc("first: BERT's pooler, tanh(Linear) of the first token ([CLS]); mean: the "
                                        "mean of the non-padded tokens")] = "first",
        pretrained: Annotated[Optional[str], Doc("a local Hugging Face BERT folder (save_pretrained: config.json, "
                                                 "model.safetensors) to start from; its config decides the shape; "
                                                 "null: random init. Nothing is downloaded")] = None,
        fused_qkv: Annotated[bool, Doc("one matmul for each block's query, key and value (true), or three "
                                       "(false: as BERT's three Linears, for measuring; the same parameters, so "
                                       "checkpoints and folders load either way)")] = True,
    ) -> None:
        super().__init__()
        require("text", "model=encoder")
        folder = _folder(pretrained) if pretrained is not None else None
        config = bert_config(vocab_size, max_positions, num_classes, pad_token_id, layers, heads, width,
                             ffn_width or 4 * width, dropout)
        if folder is not None:
            config = _folder_shape(folder, config, max_positions, num_classes, pad_token_id)
        _check_shape(config, num_classes, pad_token_id, pooling)
        self.config, self.pooling, self.pad_token_id = config, pooling, pad_token_id
        self.vocab_size, self.max_positions, self.width = vocab_size, config.max_position_embeddings, config.hidden_size
        self.embeddings = Embeddings(config)
        self.blocks = nn.ModuleList(EncoderBlock(config, fused_qkv) for _ in range(config.num_hidden_layers))
        self.pooler = nn.Linear(self.width, self.width) if pooling == "first" else None
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.width, num_classes)
        self._init_weights()
        if folder is not None:
            load_pretrained(self, folder)

    def _init_weights(self) -> None:
        """BERT's: every Linear and embedding N(0, 0.02), biases zero, LayerNorms one and zero (as
        nn.LayerNorm makes them); the padding token's embedding row zero (as transformers'
        BertPreTrainedModel)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        with torch.no_grad():
            self.embeddings.word.weight[self.pad_token_id].zero_()

    def forward(self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`attention_mask` ``[N, L]`` (true or 1: a token; false or 0: padding); None: ``ids != pad_token_id``."""
        keep = ids != self.pad_token_id if attention_mask is None else attention_mask.bool()
        # A row with no token at all attends to every position: SDPA gives NaN for a query that may attend to none.
        mask = (keep | ~keep.any(dim=-1, keepdim=True))[:, None, None, :]
        x = self.embeddings(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.classifier(self.drop(self.pool(x, keep)))

    def pool(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``[N, L, width]`` -> ``[N, width]``: BERT's pooler on the first token, or the mean of the kept tokens."""
        if self.pooler is not None:
            return torch.tanh(self.pooler(x[:, 0]))
        weights = keep.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def no_weight_decay(self) -> set[str]:
        """The embedding tables, exempt from weight decay by the optimizer's rule
        (`trainer.groups.optimizer.parameters.named_by_model`; it exempts 1-D parameters by itself)."""
        return {"embeddings.word.weight", "embeddings.position.weight", "embeddings.token_type.weight"}

    def group_matcher(self, coarse: bool = False) -> dict[str, str]:
        """The layers in timm's convention, for layer-wise lr decay (`optimizer.layer_decay`): the
        embeddings (the stem), each block, and the head (pooler and classifier, matched by neither)."""
        return {"stem": r"^embeddings\.", "blocks": r"^blocks\.(\d+)"}

    def flops_per_token(self, sequence_length: int) -> tuple[int, str]:
        """Training FLOPs per token at `sequence_length` and how they were derived."""
        return encoder_flops_per_token(self, sequence_length)

    def save_pretrained(self, folder: str | Path, class_names: Optional[list[str]] = None) -> Path:
        """Write `folder` as Hugging Face's ``BertForSequenceClassification.save_pretrained`` would:
        config.json and model.safetensors under BERT's names (q, k and v split from the fused
        projection). `class_names` (the data's, in the head's order) become the config's id2label and
        label2id. Each file is replaced atomically."""
        return save_pretrained(self, Path(folder), class_names)


class Embeddings(nn.Module):
    """Word + position + token type (one type: every token is segment 0), then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(1, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = ids.shape[-1]
        if tokens > self.position.num_embeddings:  # a shape, not a tensor value: a guard under torch.compile
            raise ValueError(f"{tokens} tokens, more than max_positions={self.position.num_embeddings}")
        positions = torch.arange(tokens, device=ids.device)
        x = self.word(ids) + self.position(positions) + self.token_type.weight[0]
        return self.drop(self.norm(x))


class EncoderBlock(nn.Module):
    """BERT's post-norm block: x = norm1(x + attn(x)), then norm2(x + ffn(x))."""

    def __init__(self, config: BertConfig, fused_qkv: bool = True) -> None:
        super().__init__()
        width, dropout = config.hidden_size, config.hidden_dropout_prob
        self.attn = EncoderAttention(width, config.num_attention_heads, qkv_bias=True,
                                     attn_dropout=config.attention_probs_dropout_prob, proj_dropout=dropout,
                                     fused_qkv=fused_qkv)
        self.norm1 = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.ffn = GeluMLP(width, config.intermediate_size, dropout, ACTIVATIONS[config.hidden_act])
        self.norm2 = nn.LayerNorm(width, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, attn_mask=mask))
        return self.norm2(x + self.ffn(x))


class EncoderAttention(SelfAttention):
    """`SelfAttention` whose q, k and v are either one fused matmul (`fused_qkv`, the default) or three,
    one per row block ``[q | k | v]`` of the same ``qkv`` parameters, as BERT's three Linears compute
    them. Keeping the parameters fused in both cases (rather than three Linear modules converted at
    load) makes the switch a change of computation only: the same initialisation draws, state-dict
    keys, optimizer state and Hugging Face names, so a checkpoint (resume included) or a folder loads
    either way. The one cost three Linears would not have: the backward of the split joins the three
    weight gradients into the fused one (one copy of 3 x width^2 values a block, against the
    projections' tokens x width^2 work)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_dropout: float = 0.0,
                 proj_dropout: float = 0.0, fused_qkv: bool = True) -> None:
        super().__init__(dim, num_heads, qkv_bias, attn_dropout, proj_dropout)
        self.fused_qkv = fused_qkv

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused_qkv:
            return super().project_qkv(x)
        biases = self.qkv.bias.chunk(3) if self.qkv.bias is not None else (None, None, None)
        return tuple(F.linear(x, weight, bias).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                     for weight, bias in zip(self.qkv.weight.chunk(3), biases))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fused_qkv={self.fused_qkv}"


# -- the shape -----------------------------------------------------------------------------------------
def bert_config(vocab_size: int, max_positions: int, num_classes: int, pad_token_id: int, layers: int,
                heads: int, width: int, ffn_width: int, dropout: float) -> BertConfig:
    """The network's shape as transformers' `BertConfig`, with `num_labels` and the architecture a
    saved folder loads as."""
    from transformers import BertConfig

    config = BertConfig(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=ffn_width, hidden_act="gelu", hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout, max_position_embeddings=max_positions, type_vocab_size=1,
                      initializer_range=INIT_STD, layer_norm_eps=NORM_EPS, pad_token_id=pad_token_id,
                      architectures=["BertForSequenceClassification"])
    config.num_labels = num_classes  # a property of every config: id2label and label2id, one entry a class
    return config


def _check_shape(config: BertConfig, num_classes: int, pad_token_id: int, pooling: str) -> None:
    """The one-line refusals of a shape the blocks cannot have."""
    for key, value in (("vocab_size", config.vocab_size), ("max_positions", config.max_position_embeddings),
                       ("num_classes", num_classes), ("layers", config.num_hidden_layers),
                       ("heads", config.num_attention_heads), ("width", config.hidden_size),
                       ("ffn_width", config.intermediate_size)):
        if value < 1:
            raise UserError(f"model.{key}", f"must be at least 1, got {value}")
    if config.hidden_size % config.num_attention_heads:
        raise UserError("model.heads", f"model.width {config.hidden_size} is not divisible by "
                        f"{config.num_attention_heads} heads", "a head count that divides model.width")
    if not 0 <= pad_token_id < config.vocab_size:
        raise UserError("model.pad_token_id", f"{pad_token_id} is not a token id below vocab_size "
                        f"{config.vocab_size}", "the data's padding id")
    if not 0 <= config.hidden_dropout_prob < 1:
        raise UserError("model.dropout", f"must be in [0, 1), got {config.hidden_dropout_prob}")
    if pooling not in ("first", "mean"):
        raise UserError("model.pooling", f"unknown pooling '{pooling}'", "first, mean")


# -- Hugging Face folders -----------------------------------------------------------------------------
def _folder(pretrained: str) -> Path:
    """The folder `model.pretrained` names, refused in one line unless it holds both files."""
    folder = Path(pretrained).expanduser()
    wanted = f"a local folder written by save_pretrained, with {CONFIG_FILE} and {WEIGHTS_FILE} (nothing is downloaded)"
    if not folder.is_dir():
        raise UserError("model.pretrained", f"'{pretrained}' is not a folder", wanted)
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        other = " (only safetensors weights are read, not pytorch_model.bin)" if (folder / "pytorch_model.bin").exists() else ""
        raise UserError("model.pretrained", f"'{pretrained}' has no {' and no '.join(missing)}{other}", wanted)
    return folder


def _folder_shape(folder: Path, given: BertConfig, max_positions: int, num_classes: int,
                  pad_token_id: int) -> BertConfig:
    """The run's config with the folder's shape (its layers, heads, width, ffn width, activation, norm
    epsilon and position table); the data's vocabulary, padding id and classes, and the run's dropout,
    kept. A shape key given with another value is overridden, and said so."""
    from transformers import BertConfig

    try:
        folder_config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as ex:
        raise UserError("model.pretrained", f"{folder / CONFIG_FILE} is not readable JSON ({ex})",
                        "a config.json written by save_pretrained") from None
    kind = folder_config.get("model_type")
    if kind != "bert" or folder_config.get("position_embedding_type", "absolute") != "absolute":
        raise UserError("model.pretrained", f"{folder / CONFIG_FILE} describes a {kind} model "
                        f"(position_embedding_type {folder_config.get('position_embedding_type', 'absolute')})",
                        "a BERT folder (model_type bert, absolute positions)")
    theirs = BertConfig.from_dict(folder_config)
    if theirs.hidden_act not in ACTIVATIONS:
        raise UserError("model.pretrained", f"{folder / CONFIG_FILE} says hidden_act {theirs.hidden_act}",
                        f"a BERT folder with hidden_act {', '.join(ACTIVATIONS)}")
    if max_positions > theirs.max_position_embeddings:
        raise UserError("model.pretrained", f"the folder's position table holds {theirs.max_position_embeddings} "
                        f"positions, the data's sequences are up to {max_positions} tokens",
                        f"data.max_length <= {theirs.max_position_embeddings}")
    shape = {"num_hidden_layers": "layers", "num_attention_heads": "heads", "hidden_size": "width",
             "intermediate_size": "ffn_width"}
    changed = [f"model.{key} {getattr(given, name)} -> {getattr(theirs, name)}" for name, key in shape.items()
               if getattr(given, name) != getattr(theirs, name)]
    if changed:
        log.info("model.pretrained: the folder's shape replaces %s", ", ".join(changed))
    config = bert_config(given.vocab_size, theirs.max_position_embeddings, num_classes, pad_token_id,
                         theirs.num_hidden_layers, theirs.num_attention_heads, theirs.hidden_size,
                         theirs.intermediate_size, given.hidden_dropout_prob)
    config.hidden_act, config.layer_norm_eps = theirs.hidden_act, theirs.layer_norm_eps
    return config


def hf_names(net: Encoder) -> dict[str, list[str]]:
    """This network's parameter names -> Hugging Face's BertForSequenceClassification names of the
    same tensor: one, or (a fused QKV) the query, key and value, in the fused layout's order."""
    names = {"embeddings.word.weight": "bert.embeddings.word_embeddings.weight",
             "embeddings.position.weight": "bert.embeddings.position_embeddings.weight",
             "embeddings.token_type.weight": "bert.embeddings.token_type_embeddings.weight",
             "embeddings.norm.weight": "bert.embeddings.LayerNorm.weight",
             "embeddings.norm.bias": "bert.embeddings.LayerNorm.bias",
             "classifier.weight": "classifier.weight", "classifier.bias": "classifier.bias"}
    if net.pooler is not None:
        names.update({"pooler.weight": "bert.pooler.dense.weight", "pooler.bias": "bert.pooler.dense.bias"})
    block_names = {"attn.qkv": [f"attention.self.{part}" for part in QKV], "attn.proj": ["attention.output.dense"],
                   "norm1": ["attention.output.LayerNorm"], "ffn.fc": ["intermediate.dense"],
                   "ffn.proj": ["output.dense"], "norm2": ["output.LayerNorm"]}
    listed = {ours: [theirs] for ours, theirs in names.items()}
    for index in range(len(net.blocks)):
        layer = f"bert.encoder.layer.{index}"
        for ours, parts in block_names.items():
            for kind in ("weight", "bias"):
                listed[f"blocks.{index}.{ours}.{kind}"] = [f"{layer}.{part}.{kind}" for part in parts]
    return listed


def hf_state_dict(net: Encoder) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face's names, q, k and v split from each fused projection (copies:
    safetensors refuses tensors that share memory)."""
    own = dict(net.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for ours, names in hf_names(net).items():
        parts = own[ours].detach().chunk(len(names))
        tensors.update(zip(names, [part.clone() for part in parts] if len(names) > 1 else parts))
    return tensors


def save_pretrained(net: Encoder, folder: Path, class_names: Optional[list[str]] = None) -> Path:
    """pooling=first: a BertForSequenceClassification folder (the pooler and the classifier with it);
    pooling=mean, which Hugging Face's classes do not have (they pool the first token): the encoder
    alone as a BertModel folder (no ``bert.`` prefix, no head), which loads into transformers' BertModel
    and into model.pretrained with a fresh head, so no class of theirs gives other logits silently."""
    from trainer.infra.atomic import write_text_atomic
    from trainer.infra.checkpoint_files import write_safetensors

    tensors, config = hf_state_dict(net), net.config
    if class_names is not None:
        if len(class_names) != net.classifier.out_features:
            raise ValueError(f"{len(class_names)} class names for a head of {net.classifier.out_features} classes")
        config = copy.deepcopy(config)
        config.id2label = dict(enumerate(str(name) for name in class_names))
        config.label2id = {str(name): index for index, name in enumerate(class_names)}
    if net.pooler is None:
        tensors = {name.removeprefix("bert."): tensor for name, tensor in tensors.items()
                   if not name.startswith("classifier.")}
        config = copy.deepcopy(config)
        config.architectures = ["BertModel"]
        log.info("model.pooling=mean: %s holds the encoder without its head (a BertModel folder; Hugging "
                 "Face's classifiers pool the first token)", folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, folder / WEIGHTS_FILE, {"format": "pt"})
    write_text_atomic(folder / CONFIG_FILE, config.to_json_string())
    return folder


def _read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors, named as BertForSequenceClassification names them: a BertModel's
    (no ``bert.`` prefix) gain it, the old ``LayerNorm.gamma``/``beta`` become ``weight``/``bias``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        raw = load_file(folder / WEIGHTS_FILE)
    except (OSError, SafetensorError) as ex:
        raise UserError("model.pretrained", f"{folder / WEIGHTS_FILE} is not a readable safetensors file ({ex})",
                        "a model.safetensors written by save_pretrained") from None
    prefixed = "bert.embeddings.word_embeddings.weight" in raw
    tensors = {}
    for name, tensor in raw.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        tensors[name if prefixed or name.startswith("classifier.") else f"bert.{name}"] = tensor
    return tensors


def load_pretrained(net: Encoder, folder: Path) -> None:
    """Copy the folder's weights into `net` (q, k and v fused; the first token type's row of the
    type table). The encoder's tensors must all be there with this network's shapes: refused in one
    line naming the tensor and both shapes otherwise. The pooler and classifier are taken where they
    fit; missing, of another class count, or (pooling=mean) trained on another feature, they keep
    their fresh initialisation, and a log line says so."""
    hf = _read_hf_weights(folder)
    if "bert.embeddings.token_type_embeddings.weight" in hf:
        hf["bert.embeddings.token_type_embeddings.weight"] = hf["bert.embeddings.token_type_embeddings.weight"][:1]
    own = dict(net.named_parameters())
    wanted = hf_names(net)
    fresh = [ours for ours, names in wanted.items() if _head(ours) and not _fits(hf, names, own[ours], net)]
    with torch.no_grad():
        for ours, names in wanted.items():
            if ours in fresh:
                continue
            tensor = torch.cat([_checked(hf, name, own[ours], len(names), folder) for name in names], dim=0)
            own[ours].copy_(tensor)
    used = {name for ours, names in wanted.items() if ours not in fresh for name in names}
    unused = sorted(set(hf) - used - {"bert.embeddings.position_ids"})
    for module in sorted({name.split(".")[0] for name in fresh}):
        log.info("model.pretrained: the %s is initialised fresh (%s)", module, _why_fresh(module, net, hf))
    log.info("model.pretrained: %d tensors loaded from %s%s", len(used), folder,
             f"; {len(unused)} not used ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})" if unused else "")


def _head(name: str) -> bool:
    return name.startswith(("pooler.", "classifier."))


def _fits(hf: Mapping[str, torch.Tensor], names: list[str], param: torch.Tensor, net: Encoder) -> bool:
    """Whether a head tensor is taken from the folder: there, of this shape, and (classifier) trained
    on the pooler's output, which this network pools too."""
    if names[0].startswith("classifier.") and net.pooler is None:
        return False
    return all(name in hf for name in names) and tuple(hf[names[0]].shape) == tuple(param.shape)


def _why_fresh(module: str, net: Encoder, hf: Mapping[str, torch.Tensor]) -> str:
    if module == "pooler":
        return "the folder has no pooler, or one of another width"
    if net.pooler is None:
        return "pooling=mean: the folder's classifier read the pooler's output"
    classifier = hf.get("classifier.weight")
    if classifier is None:
        return "the folder has no classifier"
    return f"the folder's classifier has {classifier.shape[0]} classes, the data {net.classifier.out_features}"


def _checked(hf: Mapping[str, torch.Tensor], name: str, param: torch.Tensor, parts: int, folder: Path) -> torch.Tensor:
    """The folder's tensor `name`, refused in one line when it is missing or of another shape than
    its share (1 of `parts` along the first axis) of `param`."""
    if name not in hf:
        raise UserError("model.pretrained", f"{folder / WEIGHTS_FILE} has no tensor {name}",
                        "a BERT folder (BertModel or BertForSequenceClassification's save_pretrained)")
    expected = (param.shape[0] // parts, *param.shape[1:])
    found = tuple(hf[name].shape)
    if found != expected:
        hint = "; use the folder's tokenizer.json as data.tokenizer" if "word_embeddings" in name else ""
        raise UserError("model.pretrained", f"{name} is {' x '.join(map(str, found))} in the folder, this network "
                        f"needs {' x '.join(map(str, expected))}{hint}",
                        "a folder whose shapes fit the data (its vocabulary and classes)")
    return hf[name]


# -- what the framework derives from it ----------------------------------------------------------------
def encoder_flops_per_token(net: Encoder, sequence_length: int) -> tuple[int, str]:
    """Training FLOPs (forward + backward) per token: 6N for the blocks' matmuls, 12 x layers x
    width x T for the attention scores and values (PaLM's count, Chowdhery et al. 2022, app. B;
    nothing is causal here, so nothing is left out), and the head's 6 x N_head once a sequence,
    shared by its T tokens."""
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be at least 1, got {sequence_length}")
    net = getattr(net, "_orig_mod", net)  # a torch.compile wrapper: the eager model
    blocks = sum(m.weight.numel() for m in net.blocks.modules() if isinstance(m, nn.Linear))
    head = sum(m.weight.numel() for m in (net.pooler, net.classifier) if m is not None)
    layers = len(net.blocks)
    flops = 6 * blocks + 12 * layers * net.width * sequence_length + math.ceil(6 * head / sequence_length)
    return flops, (f"6N + 12 x layers x width x T + 6 N_head / T (PaLM, Chowdhery et al. 2022, app. B): N = "
                   f"{blocks:,} block matmul parameters, N_head = {head:,}, {layers} layers, width {net.width}, "
                   f"T {sequence_length}")
