"""``data=text_classification``: labelled text for fine-tuning an encoder (task=sequence_classification),
from class folders, a .jsonl or .csv file, or the built-in set of Python standard library snippets
labelled by package; nothing is downloaded (trainer/data/labelled_corpus.py reads the sources).

The texts are tokenized once and cached; a batch is ``(ids, labels)``:

- ``ids`` int64 ``[N, L]``: each row ``[CLS] tokens [SEP]``, cut to ``max_length`` tokens and padded
  with the tokenizer's [PAD] (0 for a trained one), L the batch's longest sequence rounded up to a
  multiple of 8 and at most ``max_length``; the network derives its padding mask as ``ids != pad``;
- ``labels`` int64 ``[N]`` (class indices), or float32 ``[N, C]`` multi-hot for a multi-label set.

Training batches hold sequences of similar lengths (text.py's `length_batches`: sorted by length and
cut into whole batches, the remainder left out as a training loader drops its last short batch);
their order is shuffled each epoch by the framework's resumable sampler, one loader item a whole
batch, so a run killed mid-epoch resumes at the same batch. Validation and test batches follow the
sequences in order of length, so they need little padding. The run folder gets the tokenizer as
``tokenizer.json``, set to encode a text as the data do (serving tokenizes with it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import numpy as np
import torch

from trainer.data.base import DataInfo, SequenceRecord
from trainer.data.corpus import SPLITS
from trainer.data.labelled_corpus import (WORDPIECE, Columns, LabelSettings, PreparedLabels, open_source,
                                          prepare_labelled)
from trainer.data.text import Fraction, LengthSorted, TokenData, pad_rows, padded_width
from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, Doc, Range


class LabelledSequences(LengthSorted):
    """Sample i: (its ids, int64 [length]; its label, an int64 class index or float32 multi-hot [C]).
    `rows` are the prepared ``[n, max_length]`` ids padded with `pad_id`; `by_length` orders the
    samples by length (evaluation batches then need little padding). `batch` pads several at once."""

    def __init__(self, rows: np.ndarray, lengths: np.ndarray, labels: np.ndarray, pad_id: int,
                 by_length: bool = False) -> None:
        order = np.argsort(lengths, kind="stable") if by_length else np.arange(len(lengths))
        self.rows, self.lengths, self.labels = rows[order], lengths[order], labels[order]
        self.pad_id = pad_id
        self.limit = rows.shape[1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(self.rows[index, :self.lengths[index]].astype(np.int64))
        return ids, self._labels(self.labels[index])

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `indices` as one padded batch: a slice of the padded rows, no loop."""
        width = padded_width(int(self.lengths[indices].max()), self.limit)
        return torch.from_numpy(self.rows[indices, :width].astype(np.int64)), self._labels(self.labels[indices])

    @staticmethod
    def _labels(labels: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(labels, dtype=np.float32 if labels.dtype == np.uint8 else np.int64))

    def collate_fn(self) -> PadSequences:
        return PadSequences(self.pad_id, self.limit)


class PadSequences:
    """A loader's collate: sequences padded with `pad_id` to `padded_width`, labels stacked."""

    def __init__(self, pad_id: int, limit: int) -> None:
        self.pad_id, self.limit = pad_id, limit

    def __call__(self, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = zip(*samples)
        return pad_rows(ids, self.pad_id, self.limit), torch.stack(labels)


class LabelledTextData(TokenData[PreparedLabels]):
    """Labelled text (see the module docstring). `inspect` prepares the set (or finds it in the cache)
    and copies its tokenizer to the run's folder as ``tokenizer.json``."""

    # A few bytes a token, loaded whole: loader workers would only add copies of the arrays.
    in_memory = True
    #: Batches are padded to their own longest sequence: their length varies (compile then uses
    #: dynamic shapes, trainer/groups/compile.py).
    variable_shapes = True

    def __init__(
        self,
        source: Annotated[Optional[str], Doc("class folders (<label>/*.txt, or train/, val/, test/ holding them), "
                                             "a .jsonl or a .csv file (null: the built-in set, Python standard "
                                             "library snippets labelled by package)")] = None,
        text_column: Annotated[str, Doc(".jsonl, .csv: the field holding a sample's text")] = "text",
        label_column: Annotated[str, Doc(".jsonl, .csv: the field holding its label (in .jsonl a list of labels "
                                         "makes the set multi-label)")] = "label",
        label_separator: Annotated[Optional[str], Doc(".csv: splits a label cell into several labels (the set is "
                                                      "then multi-label); null: one label a cell")] = None,
        val_fraction: Annotated[Fraction, Doc("share of the samples held out for validation, by a hash of the "
                                              "text (unused when the source has train/ and val/ folders)")] = 0.1,
        test_fraction: Annotated[Fraction, Doc("share held out for the test")] = 0.1,
        tokenizer: Annotated[str, Doc("wordpiece: BERT-style WordPiece trained on the training split; or the path "
                                      "of a tokenizer.json with [PAD], [CLS] and [SEP] (a pretrained encoder's)")]
        = WORDPIECE,
        vocab_size: Annotated[int, AT_LEAST_ONE, Doc("tokenizer=wordpiece: the vocabulary (more when the training "
                                                     "texts' alphabet alone is larger)")] = 4096,
        max_length: Annotated[int, Range(ge=3), Doc("tokens a sequence at most, [CLS] and [SEP] included (the "
                                                    "model's max_positions); longer texts are cut")] = 128,
        cache_dir: Annotated[Optional[str], Doc("where the prepared tokens are kept (null: "
                                                "~/.cache/gpu-practice-trainer)")] = None,
        **loader: Any,
    ) -> None:
        super().__init__(cache_dir, **loader)
        if tokenizer != WORDPIECE and not Path(tokenizer).expanduser().is_file():
            raise UserError("data.tokenizer", f"'{tokenizer}' is neither wordpiece nor a file",
                            "wordpiece, or the path of a tokenizer.json")
        if label_separator is not None and not (label_separator and str(source).lower().endswith(".csv")):
            raise UserError("data.label_separator", f"'{label_separator}' " + (
                "is empty" if not label_separator else f"splits .csv label cells; the source is {source}"),
                "null, or a non-empty separator such as '|' for a .csv source")
        self.source = source
        self.settings = LabelSettings(Columns(text_column, label_column, label_separator), val_fraction,
                                      test_fraction, tokenizer, vocab_size if tokenizer == WORDPIECE else 0,
                                      max_length)

    def _prepare(self) -> PreparedLabels:
        return prepare_labelled(open_source(self.source), self.settings, self.cache_dir)

    def split_set(self, prepared: PreparedLabels, split: str) -> LabelledSequences:
        return LabelledSequences(prepared.ids(split), prepared.lengths(split), prepared.labels(split),
                                 int(prepared.meta["pad_id"]), by_length=split != "train")

    def inspect(self) -> DataInfo:
        prepared = self.prepared()
        meta = prepared.meta
        self.copy_tokenizer(prepared)
        classes, multi = list(meta["classes"]), bool(meta["multi_label"])
        record = SequenceRecord(vocab_size=int(meta["vocab_size"]), sequence_length=self.settings.max_length,
                                pad_id=int(meta["pad_id"]), multi_label=multi)
        majority = meta["majority"]
        return DataInfo(record, dict(meta["sizes"]), num_classes=len(classes), class_names=classes,
                        notes=self._notes(prepared), sample_bytes=8 * self.settings.max_length + (
                            4 * len(classes) if multi else 8),
                        baselines={"val/acc": float(majority["val_share"])} if majority else {})

    def _notes(self, prepared: PreparedLabels) -> list[str]:
        meta, sizes = prepared.meta, prepared.meta["sizes"]
        if meta["source_kind"] == "splits":
            how = "the source's train/ and val/ folders" + ("; test/ is val/" if meta["test_is_val"] else ", test/")
        else:
            how = f"drawn by a hash of each text, val {meta['val_fraction']}, test {meta['test_fraction']}"
        vocab = (f"WordPiece trained on the training split, vocabulary of {meta['vocab_size']:,}"
                 if meta["tokenizer"] == WORDPIECE else f"tokenizer {meta['tokenizer']}, vocabulary of "
                 f"{meta['vocab_size']:,}")
        kind = "multi-label" if meta["multi_label"] else "one label a sample"
        cut = ", ".join(f"{split} {meta['truncated'][split]:,} of {sizes[split]:,} "
                        f"({meta['truncated'][split] / sizes[split]:.1%})" for split in SPLITS)
        notes = [f"text: {meta['source']}",
                 f"samples: {', '.join(f'{split} {sizes[split]:,}' for split in SPLITS)} ({how}); "
                 f"{len(meta['classes'])} classes, {kind}; {vocab} (cache: {prepared.folder})",
                 f"longer than {meta['max_length']} tokens, cut: {cut}"]
        if meta["majority"]:
            notes.append(f"majority class '{meta['majority']['class']}' (of the training split): "
                         f"{meta['majority']['val_share']:.1%} of val")
        return notes

    def inference_preprocessing(self) -> dict[str, Any]:
        """For the model card: how a text becomes the network's input."""
        meta = self.prepared().meta
        return {"text": "a string", "tokenizer": "tokenizer.json (in the run folder)",
                "sequence": "[CLS] tokens [SEP]", "max_length": self.settings.max_length,
                "pad_id": int(meta["pad_id"]), "layout": "N x L int64 token ids"}
