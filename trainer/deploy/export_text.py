"""What ``deploy export`` adds for a text model: the sequences it is checked on, its model card, and
the files that make the export folder serve alone (the tokenizer; an encoder's Hugging Face folder).

An encoder (``task=sequence_classification``) is exported with the batch and the sequence length
free (1 to ``max_length``); its validation batches have different lengths (ordered by length, each
padded to its own longest), so it is checked on several of them, spread over the lengths, each as
it is (the padding masked as in training). A language model keeps its export (token ids of the
training length, batch free) and gets its tokenizer and the constructor of its network in the
card, which ``deploy serve`` rebuilds with the KV cache (docs/deploy.md, "Serving text models")."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from trainer.infra.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
HF_FOLDER = "huggingface"
#: The encoder is checked on this many validation sequences, in this many batches of different lengths.
CHECK_SEQUENCES, CHECK_GROUPS = 64, 8
#: The card's names of the text tasks: what ``deploy serve`` picks its API by.
SEQUENCE_CLASSIFICATION, LANGUAGE_MODEL = "sequence_classification", "language_model"


def evaluation_sequences(datamodule: Any, pad_id: int, count: int = CHECK_SEQUENCES,
                         groups: int = CHECK_GROUPS) -> list[torch.Tensor]:
    """Up to `count` validation sequences in up to `groups` batches spread over the lengths (the
    loader orders them by length): each batch as the network receives it, padded to its longest, so
    the check covers short and long texts and the padding mask; and first the shortest sequence
    alone at its own length (a batch of one, unpadded, as a lone short request is served). They
    cannot be concatenated: each batch has its own length."""
    datamodule.apply_loader(datamodule.loader_settings(cuda=False))
    datamodule.setup("fit")
    batches = [ids for ids, _ in datamodule.val_dataloader()]
    if not batches:
        raise UserError("data", "the validation split gives no batch to check the export on",
                        "a run whose validation split holds sequences")
    picked = sorted({round(i * (len(batches) - 1) / max(1, groups - 1)) for i in range(groups)})
    per_batch = max(2, -(-count // len(picked)))
    shortest = batches[0][:1]
    alone = shortest[:, :int((shortest != pad_id).sum())]
    return [alone, *(batches[i][:per_batch] for i in picked)]


def sequence_card(spec: Any, info: Any, datamodule: Any, run_dir: Path) -> dict[str, Any]:
    """An encoder's card, beyond the shared keys: its classes, whether they are multi-label, and how a
    text becomes its input (tokenizer, framing, maximum length, padding id)."""
    record = info.record
    tokenizer = load_run_tokenizer(run_dir)
    framing = {"cls_id": tokenizer.token_to_id("[CLS]"), "sep_id": tokenizer.token_to_id("[SEP]")}
    return {"model": spec.model["_target_"], "task": SEQUENCE_CLASSIFICATION, "kind": "sequences",
            "classes": list(info.class_names or [str(i) for i in range(info.num_classes)]),
            "multi_label": bool(record.multi_label),
            "input": {"shape": ["batch", "sequence"], "dtype": "int64", "layout": "N x L token ids",
                      "batch": "dynamic", "sequence": f"dynamic, 1 to {record.sequence_length}"},
            "text": {"tokenizer": TOKENIZER_FILE, "max_length": int(record.sequence_length),
                     "pad_id": int(record.pad_id), "framing": "[CLS] tokens [SEP]", **framing,
                     "padding": "pad_id up to the batch's longest; the network masks ids equal to pad_id"},
            "preprocessing": {**datamodule.inference_preprocessing(), "tokenizer": f"{TOKENIZER_FILE} (in this folder)"}}


def language_model_card(spec: Any, info: Any, metrics: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """A language model's card, beyond the shared keys: token ids in, next-token logits out (no image
    preprocessing), and what makes the export folder serve alone: the tokenizer (in the folder), the
    end-of-text token, the context, and the network's constructor (rebuilt by ``serve`` from
    weights.safetensors: generation keeps a KV cache, which the exported graphs have not)."""
    from trainer.data.corpus import END_OF_TEXT

    tokenizer = load_run_tokenizer(run_dir)
    inputs = info.model_inputs()
    arguments = {key: value for key, value in spec.model.items() if key != "_target_"}
    return {"model": spec.model["_target_"], "task": LANGUAGE_MODEL, "vocab_size": int(inputs["vocab_size"]),
            "input": {"shape": list(info.input_shape()), "dtype": "int64", "layout": "NT (token ids)",
                      "batch": "dynamic"},
            "output": "next-token logits, N x T x vocab_size", "tokenizer": TOKENIZER_FILE,
            "text": {"tokenizer": TOKENIZER_FILE, "end_of_text": END_OF_TEXT,
                     "end_of_text_id": tokenizer.token_to_id(END_OF_TEXT), "context": int(inputs["max_positions"])},
            "network": {"class": spec.model["_target_"], "arguments": {**arguments, "vocab_size": int(
                inputs["vocab_size"]), "max_positions": int(inputs["max_positions"])}},
            "preprocessing": {},
            "perplexity": {split: metrics.get(split, {}).get("perplexity") for split in ("val", "test")}}


def load_run_tokenizer(run_dir: Path) -> Any:
    path = run_dir / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(str(run_dir), f"has no {TOKENIZER_FILE} (a text run's data module writes it)",
                        "the folder of a run trained with data=text or data=text_classification")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def write_text_files(net: nn.Module, card: dict[str, Any], run_dir: Path, folder: Path) -> dict[str, Path]:
    """The tokenizer copied into `folder` (the staging folder), and for an encoder its Hugging Face
    folder (config.json with id2label, model.safetensors, the tokenizer): the export serves, and
    loads into transformers, with the run folder gone."""
    files = {"tokenizer": folder / TOKENIZER_FILE}
    shutil.copyfile(run_dir / TOKENIZER_FILE, files["tokenizer"])
    save = getattr(net, "save_pretrained", None)
    if card.get("task") == SEQUENCE_CLASSIFICATION and save is not None:
        files["huggingface"] = save(folder / HF_FOLDER, class_names=card["classes"])
        shutil.copyfile(run_dir / TOKENIZER_FILE, files["huggingface"] / TOKENIZER_FILE)
    return files


def max_length_of(card: dict[str, Any]) -> Optional[int]:
    """The free sequence length's upper bound of an encoder's export; None for any other (its length is fixed)."""
    return int(card["text"]["max_length"]) if card.get("task") == SEQUENCE_CLASSIFICATION else None
