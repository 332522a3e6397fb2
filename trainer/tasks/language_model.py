"""task=language_model: next-token prediction. Batches are (input ids, target ids), both N x T; a
target of -100 is padding (bucketed sequences) and counts for nothing. The loss is the mean
cross-entropy per target token; a batch is counted in tokens; perplexity is exp of the epoch's
mean loss per token (not the mean of per-batch perplexities)."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric

from trainer.data.base import DataInfo, TokenRecord
from trainer.tasks.metrics import Perplexity
from trainer.tasks.protocol import TaskDefinition

#: Targets with this id are padding: no loss, no token counted (PyTorch's cross-entropy default).
IGNORE_INDEX = -100


class TokenAccuracy(Metric):
    """The share of target tokens whose most likely next token is right (padding excluded)."""

    higher_is_better = True
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        counted = targets != IGNORE_INDEX
        self.correct = self.correct + ((logits.argmax(dim=-1) == targets) & counted).sum()
        self.total = self.total + counted.sum()

    def compute(self) -> torch.Tensor:
        return self.correct.float() / torch.clamp(self.total, min=1)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy per target token in fp32 (padding ignored)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                           label_smoothing=label_smoothing)


class LanguageModel(TaskDefinition):
    """A causal language model: the network maps token ids (N x T) to next-token logits (N x T x V)."""

    unit: ClassVar[str] = "tokens"
    data_kinds: ClassVar[tuple[str, ...]] = ("tokens",)
    model_inputs: ClassVar[tuple[str, ...]] = ("vocab_size",)
    regularization: ClassVar[tuple[str, ...]] = ("label_smoothing",)
    objective: ClassVar[str] = "val/perplexity"

    def __init__(self) -> None:
        self.label_smoothing = 0.0
        self.vocab_size = 0
        self.sequence_length = 0

    def bind(self, info: DataInfo) -> None:
        super().bind(info)
        tokens = info.record
        assert isinstance(tokens, TokenRecord)  # data_kinds: refused in one line before a bind otherwise
        self.vocab_size, self.sequence_length = tokens.vocab_size, tokens.sequence_length

    def use_regularization(self, label_smoothing: float, mixing: Any) -> None:
        self.label_smoothing = label_smoothing

    def units_in(self, batch: Any) -> int | torch.Tensor:
        # A device tensor (padding is not a token): the throughput meter adds these up on the device
        # and reads the sum once a window, so counting costs no host sync per step.
        return (self.targets(batch) != IGNORE_INDEX).sum()

    def units_per_sample(self) -> int:
        return self.sequence_length

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        return language_model_loss(outputs, targets, self.label_smoothing if training else 0.0)

    def metrics(self, split: str) -> Mapping[str, Metric]:
        return {} if split == "train" else {"token_acc": TokenAccuracy()}

    def metrics_from_loss(self) -> Mapping[str, Metric]:
        return {"perplexity": Perplexity()}

    def example_batch(self, size: int, device: torch.device) -> tuple[Any, Any]:
        ids = torch.randint(0, self.vocab_size, (size, self.sequence_length + 1), device=device)
        return ids[:, :-1], ids[:, 1:]

    def flops_per_unit(self, net: nn.Module) -> tuple[int | None, str]:
        """The network's own count when it has one (trainer.models.gpt.GPT: 6N plus attention,
        PaLM's), else torch's FLOP counter (None here)."""
        count = getattr(getattr(net, "_orig_mod", net), "flops_per_token", None)
        if callable(count):
            flops, how = count(self.sequence_length)
            return int(flops), how
        return None, ""

    def refusals(self, settings: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        data, compiled = settings.get("data", {}), settings.get("compile", {})
        if (data.get("sequences") == "bucketed" and compiled.get("mode", "off") != "off"
                and compiled.get("dynamic") is False):
            return [("compile.dynamic", "false with data.sequences=bucketed: every padded length would compile a "
                     "graph of its own", "true, or null (dynamic shapes for batches of varying length)")]
        return []

    def describe(self) -> str:
        return (f"language model: next-token cross-entropy over {self.vocab_size} tokens, perplexity; "
                f"batches in tokens ({self.sequence_length} a sequence)")

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "vocab_size": self.vocab_size, "sequence_length": self.sequence_length}
