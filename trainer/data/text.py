"""``data=text``: a language model's data from a folder of text files, or from the Python standard
library's sources when no folder is given; nothing is downloaded (docs/data.md, "Text").

The corpus is tokenized once and cached (trainer/data/corpus.py); the data sets read the token
files through memory maps. A batch is ``(input_ids, targets)``, both int64 ``[B, T]``, the targets
the next token of each input: ``packed`` sequences cut the split's tokens every T, ``bucketed`` ones
cut each document alone and pad batches of similar lengths (``batch_size`` then counts pieces).

``python -m trainer.data.text --root DIR`` prepares a corpus ahead of a run and says what it wrote."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Annotated, Any, Callable, Generic, Literal, Optional, Sequence, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.data.base import DataInfo, DataModule, TokenRecord
from trainer.data.corpus import SPLITS, CacheFolder, Prepared, TokenSettings, builtin_corpus, folder_corpus, prepare
from trainer.data.digits_expanded import default_cache_dir
from trainer.infra.atomic import replace_atomic
from trainer.infra.errors import UserError, one_line_on_user_error
from trainer.infra.schema import AT_LEAST_ONE, POSITIVE, Doc, Range

Fraction = Annotated[float, Range(gt=0, lt=0.5)]
#: What a padded input position holds (never a target: the loss skips -100).
PAD_ID = 0
IGNORE_INDEX = -100
#: Bucketed batches are padded to a multiple of this (tensor cores work in tiles of 8).
PAD_MULTIPLE = 8
#: The smallest byte-level BPE vocabulary: the 256 byte symbols and <|endoftext|>.
MIN_BPE_VOCAB = 257
#: The prepared set a `TokenData` module reads.
P = TypeVar("P", bound=CacheFolder)


class TokenFile:
    """One split's token file, opened as a memory map on first use in each process. Pickling (to a
    loader worker) carries the path only, never the open map."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, dtype
        self._map: Optional[np.ndarray] = None

    def window(self, start: int, length: int) -> torch.Tensor:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        return torch.from_numpy(self._map[start:start + length].astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype, "_map": None}


class PackedSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: the tokens ``i*T .. i*T + T`` as (inputs, targets) of T tokens each."""

    def __init__(self, tokens: TokenFile, token_count: int, sequence_length: int) -> None:
        self.tokens, self.sequence_length = tokens, sequence_length
        self.count = (token_count - 1) // sequence_length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(index)
        window = self.tokens.window(index * self.sequence_length, self.sequence_length + 1)
        return window[:-1], window[1:]


def document_pieces(offsets: np.ndarray, sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, tokens) of each piece: document d (``offsets[d] .. offsets[d + 1]``, its end-of-text
    tokens included) cut every T tokens, each piece one token longer than its sample (the last
    target); pieces overlap by that one token, so every token of the document is a target once."""
    spans = np.diff(offsets) + 1
    pieces = -(-(spans - 1) // sequence_length)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum())) - first
    starts = np.repeat(offsets[:-1], pieces) + k * sequence_length
    lengths = np.minimum(sequence_length + 1, np.repeat(spans, pieces) - k * sequence_length)
    return starts.astype(np.int64), lengths.astype(np.int64)


def padded_width(longest: int, limit: int) -> int:
    """A batch's length: its longest sequence rounded up to a multiple of `PAD_MULTIPLE`, at most `limit`."""
    return max(longest, min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, limit))


def pad_rows(sequences: Sequence[torch.Tensor], value: int, limit: int) -> torch.Tensor:
    """Sequences of different lengths as the rows of one int64 tensor, padded with `value` to `padded_width`."""
    rows = torch.full((len(sequences), padded_width(max(map(len, sequences)), limit)), value, dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        rows[row, :len(sequence)] = sequence
    return rows


class PadToLongest:
    """A loader's collate: samples of different lengths padded to `padded_width`; inputs with
    `PAD_ID`, targets with -100."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = zip(*samples)
        return pad_rows(inputs, PAD_ID, self.limit), pad_rows(targets, IGNORE_INDEX, self.limit)


class LengthSorted(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples of different lengths (`lengths`), which a training loader takes in batches of similar
    lengths (`LengthGroupedBatches`); `collate_fn`, the base class's hook for a data set that
    batches its own way, pads them."""

    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples `indices` as one padded batch."""
        return self.collate_fn()([self[int(i)] for i in indices])

    def collate_fn(self) -> Callable[[Sequence[tuple[torch.Tensor, torch.Tensor]]], tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError


class DocumentPieces(LengthSorted):
    """Sample i: piece i of the documents as (inputs, targets) of 1..T tokens; `collate_fn` pads.
    `by_length`: the pieces in order of length (evaluation batches then need little padding)."""

    def __init__(self, tokens: TokenFile, offsets: np.ndarray, sequence_length: int, by_length: bool = False) -> None:
        self.tokens, self.sequence_length = tokens, sequence_length
        self.starts, self.lengths = document_pieces(offsets, sequence_length)
        if by_length:
            order = np.argsort(self.lengths, kind="stable")
            self.starts, self.lengths = self.starts[order], self.lengths[order]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens.window(int(self.starts[index]), int(self.lengths[index]))
        return window[:-1], window[1:]

    def collate_fn(self) -> PadToLongest:
        return PadToLongest(self.sequence_length)


def length_batches(lengths: np.ndarray, batch_size: int) -> np.ndarray:
    """Indices ``[batches, batch_size]`` of pieces grouped by length: the pieces sorted by length
    (ties in a fixed shuffled order, so that a batch of full-length pieces mixes documents) and
    cut into whole batches; the remainder (fewer than a batch, the longest pieces) is left out, as
    a training loader drops its last short batch. The same lengths give the same batches."""
    ties = np.random.default_rng(0).permutation(len(lengths))
    order = np.lexsort((ties, lengths))
    whole = len(order) // batch_size * batch_size
    return order[:whole].reshape(-1, batch_size)


class LengthGroupedBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item k: batch k of `length_batches` over the samples' lengths, padded. A loader item is a whole
    batch, so that the resumable sampler orders and counts batches (`items_per_batch` 1)."""

    def __init__(self, samples: LengthSorted, batch_size: int) -> None:
        self.samples = samples
        self.batches = length_batches(samples.lengths, batch_size)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.samples.batch(self.batches[index])


class TokenData(DataModule, Generic[P]):
    """What the text data modules share: the set tokenized once and cached (`prepared`, made by
    `_prepare`) with its tokenizer copied to the run's folder (`copy_tokenizer`), the splits
    (`split_set`), length-sorted training samples taken in batches of similar lengths."""

    # Token ids reach the network as they are: nothing to finish on the host or the device.
    finishes_on_host_itself = True

    def __init__(self, cache_dir: Optional[str], **loader: Any) -> None:
        super().__init__(**loader)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self._prepared: Optional[P] = None

    def prepared(self) -> P:
        """The set tokenized, from the cache or made now (once per data module)."""
        if self._prepared is None:
            self._prepared = self._prepare()
        return self._prepared

    def _prepare(self) -> P:
        raise NotImplementedError

    def split_set(self, prepared: P, split: str) -> Dataset[Any]:
        raise NotImplementedError

    def copy_tokenizer(self, prepared: P) -> None:
        """The prepared tokenizer to the run's folder as ``tokenizer.json``: what generation
        (trainer.generate) decodes the model's ids with, what serving tokenizes a text with."""
        if self.run_dir is not None:
            source = prepared.tokenizer_file
            replace_atomic(self.run_dir / "tokenizer.json", lambda tmp: shutil.copyfile(source, tmp))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            prepared = self.prepared()
            self.train_set, self.val_set, self.test_set = (self.split_set(prepared, split) for split in SPLITS)

    def _dataloader(self, dataset: Dataset[Any] | None, train: bool) -> DataLoader[Any]:
        if not (train and isinstance(dataset, LengthSorted)):
            return super()._dataloader(dataset, train)
        # Grouped here, not in setup, as batch_size=auto sets the batch after setup.
        return self.grouped_batch_loader(LengthGroupedBatches(dataset, self.batch_size))

    def finish_batch(self, batch: Any, training: bool) -> Any:
        return batch  # token ids: nothing to normalize or augment


class TextData(TokenData[Prepared]):
    """A language model's data (see the module docstring). `inspect` prepares the corpus (or finds
    it in the cache) and copies its tokenizer to the run's folder as ``tokenizer.json``."""

    def __init__(
        self,
        root: Annotated[Optional[str], Doc("a folder of text files, read recursively (null: the built-in corpus, "
                                           "the Python standard library's .py sources)")] = None,
        glob: Annotated[Optional[str], Doc("the files of root to read, matched in every subfolder (null: *.txt, "
                                           "*.md, *.py, *.rst)")] = None,
        tokenizer: Annotated[Literal["bpe", "byte"], Doc("bpe: byte-level BPE trained on the training split; "
                                                         "byte: the 256 bytes and <|endoftext|>, no training")] = "bpe",
        vocab_size: Annotated[int, AT_LEAST_ONE, Doc("tokenizer=bpe: the vocabulary, at least 257 (fewer when the "
                                                     "corpus has no more pairs to merge)")] = 2048,
        sequence_length: Annotated[int, Range(ge=2), Doc("tokens per sample (the model's max_positions)")] = 128,
        sequences: Annotated[Literal["packed", "bucketed"],
                             Doc("packed: documents end to end, cut every sequence_length tokens; bucketed: "
                                 "each document cut alone, batches of similar lengths padded")] = "packed",
        val_fraction: Annotated[Fraction, Doc("share of the documents held out for validation (by a hash of "
                                              "their path)")] = 0.05,
        test_fraction: Annotated[Fraction, Doc("share held out for the test")] = 0.05,
        max_corpus_mb: Annotated[Optional[Annotated[float, POSITIVE]],
                                 Doc("root=null: the most of the standard library read, in MB (null: all of "
                                     "it)")] = 6.0,
        cache_dir: Annotated[Optional[str], Doc("where the prepared tokens are kept (null: "
                                                "~/.cache/gpu-practice-trainer)")] = None,
        **loader: Any,
    ) -> None:
        super().__init__(cache_dir, **loader)
        if tokenizer == "bpe" and vocab_size < MIN_BPE_VOCAB:
            raise UserError("data.vocab_size", f"{vocab_size} is smaller than a byte-level BPE vocabulary can be "
                            "(256 byte symbols and <|endoftext|>)", f"at least {MIN_BPE_VOCAB}, or data.tokenizer=byte")
        if glob and not root:
            raise UserError("data.glob", f"'{glob}' chooses files of data.root, which is null (the built-in corpus)",
                            "null, or a data.root folder to match it in")
        self.root, self.glob = root, glob
        self.settings = TokenSettings(tokenizer, vocab_size if tokenizer == "bpe" else MIN_BPE_VOCAB,
                                      val_fraction, test_fraction)
        self.sequence_length = sequence_length
        self.sequences = sequences
        self.max_corpus_mb = max_corpus_mb

    def _prepare(self) -> Prepared:
        corpus = folder_corpus(self.root, self.glob) if self.root else builtin_corpus(self.max_corpus_mb)
        return prepare(corpus, self.settings, self.cache_dir)

    def split_set(self, prepared: Prepared, split: str) -> Dataset[Any]:
        tokens = TokenFile(prepared.token_file(split), prepared.dtype)
        if self.sequences == "packed":
            return PackedSequences(tokens, prepared.meta["tokens"][split], self.sequence_length)
        return DocumentPieces(tokens, prepared.offsets(split), self.sequence_length, by_length=split != "train")

    def inspect(self) -> DataInfo:
        prepared = self.prepared()
        sizes = {split: len(cast(Any, self.split_set(prepared, split))) for split in SPLITS}
        self._check_sizes(sizes, prepared)
        self.copy_tokenizer(prepared)
        meta, T = prepared.meta, self.sequence_length
        tokens = ", ".join(f"{split} {meta['tokens'][split]:,}" for split in SPLITS)
        vocab = f"{meta['tokenizer']} vocabulary of {meta['vocab_size']}"
        if meta["vocab_size"] < meta["vocab_size_asked"]:
            vocab += f" (of {meta['vocab_size_asked']} asked: the corpus had no more pairs to merge)"
        notes = [f"text: {meta['corpus']}",
                 f"tokens: {tokens}; {vocab}; {self.sequences} sequences of {T} (cache: {prepared.folder})"]
        return DataInfo(TokenRecord(vocab_size=int(meta["vocab_size"]), sequence_length=T), sizes, notes=notes,
                        sample_bytes=2 * 8 * T,
                        baselines={"val/perplexity": float(meta["unigram_val_perplexity"])})

    def _check_sizes(self, sizes: dict[str, int], prepared: Prepared) -> None:
        key = "data.root" if self.root else "data.max_corpus_mb"
        if sizes["train"] < self.batch_size:
            raise UserError(key, f"the training split gives {sizes['train']} sequences of {self.sequence_length} "
                            f"tokens ({prepared.meta['tokens']['train']:,} tokens), fewer than one batch of "
                            f"{self.batch_size}", "a larger corpus, or a smaller data.sequence_length or data.batch_size")
        for split in ("val", "test"):
            if sizes[split] == 0:
                raise UserError("data.sequence_length", f"the {split} split holds {prepared.meta['tokens'][split]} "
                                f"tokens, not one sequence of {self.sequence_length}",
                                f"a smaller data.sequence_length, a larger data.{split}_fraction, or a larger corpus")

    @property
    def variable_shapes(self) -> bool:
        """Bucketed batches are padded to their own longest piece: their length varies (compile then
        uses dynamic shapes, trainer/groups/compile.py)."""
        return self.sequences == "bucketed"


# -- python -m trainer.data.text -------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.text",
                                     description="Tokenize a corpus for data=text ahead of a run, into the cache a "
                                                 "run with the same settings reads.")
    parser.add_argument("--root", help="a folder of text files (default: the built-in corpus)")
    parser.add_argument("--glob", help="the files of --root to read (default: *.txt, *.md, *.py, *.rst)")
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--test-fraction", type=float, default=0.05)
    parser.add_argument("--max-corpus-mb", type=float, default=6.0, help="the built-in corpus's cap")
    parser.add_argument("--cache-dir", help="default: ~/.cache/gpu-practice-trainer (the runs' default)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    with one_line_on_user_error():
        data = TextData(root=args.root, glob=args.glob, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                        val_fraction=args.val_fraction, test_fraction=args.test_fraction,
                        max_corpus_mb=args.max_corpus_mb, cache_dir=args.cache_dir)
        prepared = data.prepared()
    meta = prepared.meta
    print(f"corpus: {meta['corpus']}")
    print(f"tokenizer: {meta['tokenizer']}, vocabulary of {meta['vocab_size']}")
    for split in SPLITS:
        print(f"{split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens")
    print(f"unigram perplexity on val: {meta['unigram_val_perplexity']:.1f}")
    print(f"written: {prepared.folder} ({', '.join(sorted(path.name for path in prepared.folder.iterdir()))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
