"""Labelled text for sequence classification (data=text_classification): from a source to token
arrays kept in a cache. Free of torch: the data module (trainer/data/labelled_text.py) reads what
is written here.

A source (`data.source`) is one of:

- null: the built-in set (`builtin_samples`), snippets of the Python standard library labelled by
  the package they come from; nothing is downloaded;
- a folder of class folders, ``<label>/*.txt``, one file one sample; when it has ``train/`` and
  ``val/`` (and optionally ``test/``) subfolders of class folders, those are the splits (without
  ``test/`` the test split is ``val/``);
- a ``.jsonl`` file, one JSON object a line with a text and a label field (`data.text_column`,
  `data.label_column`); a label that is a list (``["a", "b"]``) makes the set multi-label;
- a ``.csv`` file whose header names the text and label columns; `data.label_separator` splits a
  label cell into several labels (multi-label).

Without explicit splits each sample goes to train, val or test by a hash of its text
(`corpus.split_of`), never by its position: adding or reordering samples moves no other one, and
identical texts share a split. The classes are the labels of the training split; a val or test
label that no training sample has is refused.

`prepare_labelled` trains a WordPiece tokenizer on the training texts only (or loads a given
``tokenizer.json``), encodes every text as ``[CLS] tokens [SEP]`` cut to `max_length` tokens, and
keeps the arrays in a folder named by a hash of the source's bytes and every setting, written under
a temporary name and renamed into place as corpus.py does, so that a crash or a second process
never sees half of it."""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import os
import platform
import re
import sysconfig
import textwrap
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import numpy as np

# corpus.py's helpers: the split by hash, the folders its standard library corpus leaves out, the
# content hash of files (Corpus.fingerprint) and the cache folders (named by a key, made whole or not at all).
from trainer.data.corpus import (EXCLUDED_STDLIB, SPLITS, CacheFolder, Corpus, _unit_hash, keyed_folder, split_of,
                                 write_cached)
from trainer.infra.errors import UserError, choices
from trainer.infra.extras import require

#: Bump when the way the arrays are made changes: older cache folders are then not read.
RECIPE_VERSION = 1
#: A trained tokenizer's special tokens, ids 0-3 in this order.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
#: What a given tokenizer.json must have: the padding and the tokens around every sequence.
REQUIRED_TOKENS = ("[PAD]", "[CLS]", "[SEP]")
WORDPIECE = "wordpiece"
FILE_SUFFIXES = (".jsonl", ".csv")
SOURCES_ALLOWED = ("null (the built-in set), a folder of class folders (<label>/*.txt, or train/, val/ and optionally "
                   "test/ each holding them), a .jsonl or a .csv file")
#: The built-in set's classes: packages of the standard library in every CPython from 3.10 to 3.13.
BUILTIN_PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
#: Snippets kept per package (each package gives more on CPython 3.11, so the classes are balanced).
BUILTIN_PER_CLASS = 200
#: A snippet is cut to this many characters, and left out when shorter than `MIN_SNIPPET_CHARS`.
BUILTIN_CHARS = 2000
MIN_SNIPPET_CHARS = 80
#: Texts encoded per call of the tokenizer (bounds the memory of encoding a large set).
ENCODE_CHUNK = 1024


class Sample(NamedTuple):
    """One labelled text; `where` (its file, and line) names it in an error, `split` is the one the
    source gives (train/, val/, test/ folders), else None (the split is drawn by a hash of the text)."""

    text: str
    labels: tuple[str, ...]
    where: str
    split: Optional[str] = None


@dataclass(frozen=True)
class Columns:
    """Where a .jsonl or .csv file keeps a sample's text and label, and what splits a CSV label cell."""

    text: str = "text"
    label: str = "label"
    separator: Optional[str] = None


@dataclass(frozen=True)
class LabelSettings:
    """What shapes the arrays besides the source (the cache key holds both); `tokenizer` is
    ``wordpiece`` or the path of a tokenizer.json."""

    columns: Columns
    val_fraction: float
    test_fraction: float
    tokenizer: str
    vocab_size: int
    max_length: int


# -- sources ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """A source of labelled text: `kind` (builtin, folders, splits, jsonl, csv) and its files, whose
    bytes (`fingerprint`) key the cache; `per_class` caps the built-in set."""

    kind: str
    files: Corpus
    per_class: int = 0

    @property
    def description(self) -> str:
        return self.files.description

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.per_class}\0{self.files.fingerprint()}".encode()).hexdigest()

    def read(self, columns: Columns) -> tuple[list[Sample], bool]:
        """Every sample of the source, in its files' order, and whether the set is multi-label."""
        if self.kind == "builtin":
            return builtin_samples(self.per_class), False
        if self.kind in ("folders", "splits"):
            return _folder_samples(self), False
        path = self.files.root / self.files.files[0]
        text = self.files.read(self.files.files[0]).decode("utf-8-sig", errors="replace")
        return _jsonl_samples(path, text, columns) if self.kind == "jsonl" else _csv_samples(path, text, columns)


def open_source(source: Optional[str], per_class: Optional[int] = None) -> Source:
    """The source `data.source` names, its files listed (nothing is read yet); `per_class` caps the
    built-in set (null: `BUILTIN_PER_CLASS`)."""
    if source is None:
        per_class = per_class or BUILTIN_PER_CLASS
        root, files = builtin_files()
        return Source("builtin", Corpus(root, files, builtin_description(per_class), "data.source"), per_class)
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError("data.source", f"'{source}' does not exist", SOURCES_ALLOWED)
    if path.is_dir():
        return _folder_source(path)
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise UserError("data.source", f"'{source}' is a {suffix or 'suffix-less'} file, which is not read",
                        SOURCES_ALLOWED)
    description = f"{path}: {path.stat().st_size / 1e6:.2f} MB"
    return Source(suffix[1:], Corpus(path.parent, (path.name,), description, "data.source"))


def _folder_source(root: Path) -> Source:
    """Class folders in `root`, or in its train/, val/ (and test/) subfolders: split folders when
    train/ holds class folders of .txt files rather than .txt files (a class may be called train)."""
    if _class_files(root, "train") and not list((root / "train").glob("*.txt")):
        if not (root / "val").is_dir():
            raise UserError("data.source", f"'{root}' has a train/ folder but no val/", SOURCES_ALLOWED)
        files = [name for split in SPLITS if (root / split).is_dir() for name in _class_files(root, split)]
        kind = "splits"
    else:
        files, kind = _class_files(root, ""), "folders"
    if not files:
        raise UserError("data.source", f"'{root}' holds no class folder with .txt files", SOURCES_ALLOWED)
    classes = {name.split("/")[-2] for name in files}
    description = f"{root}: {len(files)} files in {len(classes)} class folders" + (
        " under train/, val/" + (", test/" if (root / "test").is_dir() else "") if kind == "splits" else "")
    return Source(kind, Corpus(root, tuple(files), description, "data.source"))


def _class_files(root: Path, under: str) -> list[str]:
    """The .txt files of each class folder of ``root/under`` (relative to root, sorted); hidden ones left out."""
    base = root / under if under else root
    if not base.is_dir():
        return []
    folders = sorted(folder for folder in base.iterdir() if folder.is_dir() and not folder.name.startswith("."))
    return [path.relative_to(root).as_posix() for folder in folders for path in sorted(folder.glob("*.txt"))
            if path.is_file() and not path.name.startswith(".")]


def _folder_samples(source: Source) -> list[Sample]:
    samples = []
    for relative in source.files.files:
        *split, label, _ = relative.split("/")
        text = source.files.read(relative).decode("utf-8", errors="replace")
        samples.append(_sample(text, (label,), str(source.files.root / relative), split[0] if split else None))
    return samples


def _sample(text: str, labels: tuple[str, ...], where: str, split: Optional[str] = None,
            multi: bool = False) -> Sample:
    if not text.strip():
        raise UserError(where, "empty text", "a text in every sample")
    if not multi and (len(labels) != 1 or not labels[0]):
        raise UserError(where, "no label", "one label a sample (several only in a multi-label set)")
    return Sample(text, labels, where, split)


def _jsonl_samples(path: Path, text: str, columns: Columns) -> tuple[list[Sample], bool]:
    """One sample a non-blank line; a label that is a list in any line makes every line's a list."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as ex:
            raise UserError(where, f"not JSON ({ex})", "one JSON object a line") from None
        if not isinstance(row, dict):
            raise UserError(where, f"a JSON {type(row).__name__}, not an object", "one JSON object a line")
        fields = {"text": columns.text, "label": columns.label}
        for what, field in fields.items():
            if field not in row:
                raise UserError(where, f"no '{field}' field (data.{what}_column)",
                                f"data.{what}_column naming a field of every line: {choices(sorted(row))}")
        if not isinstance(row[columns.text], str):
            raise UserError(where, f"the '{columns.text}' field is not a string", "a text in every line")
        rows.append((row[columns.text], row[columns.label], where))
    multi = any(isinstance(label, list) for _, label, _ in rows)
    return [_sample(text, _labels(label, where), where, multi=multi) for text, label, where in rows], multi


def _labels(value: Any, where: str) -> tuple[str, ...]:
    """A JSON label (a string or an integer) or a list of them, as strings (blank ones and repeats dropped)."""
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise UserError(where, f"the label {json.dumps(item)} is neither a string nor an integer",
                            "a label (string or integer), or a list of them for several labels")
    return tuple(dict.fromkeys(label for label in (str(item).strip() for item in values) if label))


def _csv_samples(path: Path, text: str, columns: Columns) -> tuple[list[Sample], bool]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = list(reader.fieldnames or [])
    for key, column in (("data.text_column", columns.text), ("data.label_column", columns.label)):
        if column not in header:
            raise UserError(key, f"'{column}' is not a column of {path}",
                            f"one of its header's columns: {choices(header)}" if header else "a header line")
    samples, multi = [], columns.separator is not None
    for row in reader:
        where = f"{path}:{reader.line_num}"
        cell = (row.get(columns.label) or "").strip()
        labels = tuple(dict.fromkeys(part.strip() for part in cell.split(columns.separator) if part.strip())) \
            if multi else (cell,)
        samples.append(_sample(row.get(columns.text) or "", labels, where, multi=multi))
    return samples, multi


# -- the built-in set ------------------------------------------------------------------------------
def builtin_files() -> tuple[Path, tuple[str, ...]]:
    """The standard library's folder and the .py files of `BUILTIN_PACKAGES` (relative, sorted), less
    the folders the built-in corpus of data=text leaves out (test suites above all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path.relative_to(root).as_posix() for package in BUILTIN_PACKAGES
                   for path in (root / package).rglob("*.py")
                   if not set(path.relative_to(root).parts[1:-1]) & EXCLUDED_STDLIB)
    return root, tuple(files)


def builtin_description(per_class: int) -> str:
    return (f"the Python {platform.python_version()} standard library: snippets of {len(BUILTIN_PACKAGES)} packages "
            f"({', '.join(BUILTIN_PACKAGES)}), at most {per_class} each, labelled by package")


def snippets(source: str) -> Iterator[str]:
    """The source of each top-level function, of each method of a top-level class (dedented), and of
    each top-level class without methods: their whole lines (not `ast.get_source_segment`, which
    splits the module's lines again for every call)."""
    with warnings.catch_warnings():  # invalid escapes in old modules' strings, on newer Pythons
        warnings.simplefilter("ignore")
        tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions):
            yield "".join(lines[node.lineno - 1:node.end_lineno])
        elif isinstance(node, ast.ClassDef):
            methods: list[ast.stmt] = [item for item in node.body if isinstance(item, functions)]
            for item in methods or [node]:
                yield textwrap.dedent("".join(lines[item.lineno - 1:item.end_lineno]))


def builtin_samples(per_class: int = BUILTIN_PER_CLASS) -> list[Sample]:
    """The built-in data set: Python source snippets (`snippets`, each cut to `BUILTIN_CHARS`
    characters) of the standard library packages `BUILTIN_PACKAGES`, labelled by the package:
    which part of the library a piece of code belongs to (8 classes). Snippets shorter than
    `MIN_SNIPPET_CHARS` and texts found more than once are left out; each package keeps at most
    `per_class`, chosen by a hash of their text (never by file order). On CPython 3.11 every package
    gives more than 200 (http the fewest, 213), so the classes are balanced: each is 1/8 = 12.5% of
    the 1,600 samples. A split drawn by hash is only about balanced: at the default fractions the
    training split's most frequent class (email) is 9.8% of val, the accuracy of always predicting it
    (`majority`, the run's baseline). The same Python gives the same samples."""
    root, files = builtin_files()
    found: dict[str, list[tuple[str, str]]] = {package: [] for package in BUILTIN_PACKAGES}
    for name in files:
        try:
            texts = list(snippets((root / name).read_text(encoding="utf-8", errors="replace")))
        except SyntaxError:  # a module of another Python's syntax: nothing in it is read
            continue
        found[name.split("/")[0]] += [(text[:BUILTIN_CHARS], name) for text in texts]
    seen = Counter(text for pieces in found.values() for text, _ in pieces)
    samples = []
    for package, pieces in found.items():
        kept = sorted((item for item in pieces if seen[item[0]] == 1 and len(item[0]) >= MIN_SNIPPET_CHARS),
                      key=lambda item: _unit_hash(f"order\0{item[0]}"))
        samples += [Sample(text, (package,), str(root / name)) for text, name in kept[:per_class]]
    return samples


# -- splits and classes ----------------------------------------------------------------------------
def split_samples(source: Source, samples: list[Sample], val_fraction: float,
                  test_fraction: float) -> dict[str, list[Sample]]:
    """The samples of each split: the source's own, else drawn by a hash of the text. A source with
    train/ and val/ but no test/ measures the test on val/."""
    splits: dict[str, list[Sample]] = {split: [] for split in SPLITS}
    for sample in samples:
        splits[sample.split or split_of(sample.text, val_fraction, test_fraction)].append(sample)
    if source.kind == "splits" and not splits["test"]:
        splits["test"] = splits["val"]
    for split, key in (("train", "data.source"), ("val", "data.val_fraction"), ("test", "data.test_fraction")):
        if not splits[split]:
            raise UserError(key, f"none of the {len(samples)} samples is in the {split} split",
                            "more samples" + ("" if split == "train" else f", or a larger data.{split}_fraction"))
    return splits


def class_names(splits: dict[str, list[Sample]], source: Source) -> list[str]:
    """The labels of the training split, in order (numeric labels by value): the classes. Refused:
    fewer than 2, and a val or test label no training sample has."""
    known = {label for sample in splits["train"] for label in sample.labels}
    ordered = all(re.fullmatch(r"-?\d+", label) for label in known)
    names = sorted(known, key=lambda label: (int(label), label)) if ordered else sorted(known)
    if len(names) < 2:
        raise UserError("data.source", f"the training split of {source.description} has {len(names)} class"
                        f"{'' if len(names) == 1 else 'es'} ({choices(names) or 'no labels'})", "at least 2 classes")
    for split in ("val", "test"):
        for sample in splits[split]:
            unknown = [label for label in sample.labels if label not in known]
            if unknown:
                drawn = "" if sample.split else " (the split is drawn by a hash of each text: give the label more samples)"
                raise UserError(sample.where, f"unknown label '{unknown[0]}' in the {split} split: no training "
                                "sample has it" + drawn, f"the training split's labels: {choices(names[:20])}"
                                + (", ..." if len(names) > 20 else ""))
    return names


# -- tokenizers ------------------------------------------------------------------------------------
def train_wordpiece(texts: Iterable[str], vocab_size: int) -> Any:
    """A BERT-style WordPiece tokenizer (BERT's normalizer, lower-casing, and pre-tokenizer, as the
    uncased BERTs) trained on `texts`: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, then the alphabet and the
    word pieces, up to `vocab_size` (more when the alphabet alone is larger). Deterministic."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                        show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str) -> Any:
    """A tokenizer.json as `tokenizers` saves it (that of a pretrained encoder), its own truncation
    and padding turned off (the data module cuts and pads)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as ex:  # tokenizers raises a bare Exception for a file it cannot parse
        raise UserError("data.tokenizer", f"cannot load {path}: {str(ex).splitlines()[0] if str(ex) else ex!r}",
                        "a tokenizer.json saved by Hugging Face tokenizers") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def special_ids(tokenizer: Any, where: str) -> dict[str, int]:
    """The ids of [PAD], [CLS] and [SEP]; a tokenizer without one of them is refused."""
    ids = {}
    for token in REQUIRED_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is None:
            raise UserError("data.tokenizer", f"{where} has no {token} token",
                            "a tokenizer.json with [PAD], [CLS] and [SEP] (a BERT-style WordPiece), or wordpiece")
        ids[token] = int(found)
    return ids


def encode_texts(tokenizer: Any, texts: list[str], ids: dict[str, int], max_length: int,
                 dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """(rows, lengths, truncated): each text as ``[CLS] tokens [SEP]`` in a row of `max_length` ids
    padded with [PAD], the tokens cut to ``max_length - 2``; its length; how many texts were cut."""
    rows = np.full((len(texts), max_length), ids["[PAD]"], dtype=dtype)
    lengths = np.zeros(len(texts), dtype=np.int64)
    truncated = 0
    for start in range(0, len(texts), ENCODE_CHUNK):
        encodings = tokenizer.encode_batch(texts[start:start + ENCODE_CHUNK], add_special_tokens=False)
        for row, encoding in enumerate(encodings, start):
            tokens = encoding.ids
            truncated += len(tokens) > max_length - 2
            sequence = [ids["[CLS]"], *tokens[:max_length - 2], ids["[SEP]"]]
            rows[row, :len(sequence)] = sequence
            lengths[row] = len(sequence)
    return rows, lengths, truncated


def as_served(tokenizer: Any, ids: dict[str, int], max_length: int) -> Any:
    """`tokenizer` set to encode a text as the data do (``[CLS] tokens [SEP]``, at most `max_length`
    ids): what the run folder's tokenizer.json does for serving."""
    from tokenizers import processors

    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    tokenizer.enable_truncation(max_length)
    return tokenizer


# -- the prepared folder ---------------------------------------------------------------------------
class PreparedLabels(CacheFolder):
    """A prepared set: per split ``{split}.ids.npy`` ([n, max_length] token ids, padded),
    ``{split}.lengths.npy`` and ``{split}.labels.npy`` (class indices, or [n, classes] multi-hot
    uint8), with ``tokenizer.json`` and ``meta.json``."""

    def ids(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.ids.npy")

    def lengths(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.lengths.npy")

    def labels(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.labels.npy")


def cache_folder(cache_dir: Path, source: Source, settings: LabelSettings) -> Path:
    """The folder named by the source's bytes and every setting (a given tokenizer by its bytes)."""
    tokenizer = settings.tokenizer
    if tokenizer != WORDPIECE:
        tokenizer = hashlib.sha256(_read_tokenizer_file(tokenizer)).hexdigest()
    return keyed_folder(cache_dir, "labels", {"version": RECIPE_VERSION, "source": source.fingerprint(),
                                              **asdict(settings), "tokenizer": tokenizer})


def _read_tokenizer_file(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as ex:
        raise UserError("data.tokenizer", f"cannot read {path}: {ex.strerror}",
                        "wordpiece, or the path of a tokenizer.json") from None


def prepare_labelled(source: Source, settings: LabelSettings, cache_dir: Path) -> PreparedLabels:
    """The prepared set from the cache, or made now and cached."""
    folder = cache_folder(cache_dir, source, settings)
    found = PreparedLabels.read(folder)
    if found is not None:
        return found
    require("text", "data=text_classification")
    samples, multi = source.read(settings.columns)
    splits = split_samples(source, samples, settings.val_fraction, settings.test_fraction)
    names = class_names(splits, source)
    make = partial(_make, source, splits, names, multi, settings)
    return write_cached(PreparedLabels, folder, "the prepared set", make)


def _make(source: Source, splits: dict[str, list[Sample]], names: list[str], multi: bool,
          settings: LabelSettings, out: Path) -> dict[str, Any]:
    """Write the tokenizer and every split's arrays into `out`; what meta.json says."""
    trained = settings.tokenizer == WORDPIECE
    if trained:
        tokenizer = train_wordpiece((sample.text for sample in splits["train"]), settings.vocab_size)
    else:
        tokenizer = load_tokenizer(settings.tokenizer)
    ids = special_ids(tokenizer, "the trained tokenizer" if trained else settings.tokenizer)
    # Loader workers forked after the tokenizer used its threads would each warn that tokenizers'
    # parallelism is now off; they never tokenize, so say so once (a person's own setting stands).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vocab_size = int(tokenizer.get_vocab_size())
    dtype = np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)
    index = {name: i for i, name in enumerate(names)}
    truncated, tokens = {}, {}
    for split, samples in splits.items():
        rows, lengths, truncated[split] = encode_texts(tokenizer, [s.text for s in samples], ids,
                                                       settings.max_length, dtype)
        tokens[split] = int(lengths.sum())
        np.save(out / f"{split}.ids.npy", rows)
        np.save(out / f"{split}.lengths.npy", lengths)
        np.save(out / f"{split}.labels.npy", _label_array(samples, index, multi))
    as_served(tokenizer, ids, settings.max_length).save(str(out / "tokenizer.json"))
    return {"version": RECIPE_VERSION, "source": source.description, "source_kind": source.kind,
            "classes": names, "multi_label": multi, "tokenizer": settings.tokenizer,
            "vocab_size_asked": settings.vocab_size, "vocab_size": vocab_size, "pad_id": ids["[PAD]"],
            "cls_id": ids["[CLS]"], "sep_id": ids["[SEP]"], "dtype": dtype.name, "max_length": settings.max_length,
            "sizes": {split: len(samples) for split, samples in splits.items()}, "truncated": truncated,
            "tokens": tokens, "test_is_val": splits["test"] is splits["val"],
            "val_fraction": settings.val_fraction, "test_fraction": settings.test_fraction,
            "majority": None if multi else majority(splits, names)}


def _label_array(samples: list[Sample], index: dict[str, int], multi: bool) -> np.ndarray:
    if not multi:
        return np.asarray([index[sample.labels[0]] for sample in samples], dtype=np.int64)
    hot = np.zeros((len(samples), len(index)), dtype=np.uint8)
    for row, sample in enumerate(samples):
        hot[row, [index[label] for label in sample.labels]] = 1
    return hot


def majority(splits: dict[str, list[Sample]], names: list[str]) -> dict[str, Any]:
    """The training split's most frequent class (the first in class order on a tie) and its share
    of the val split: the accuracy of always predicting it."""
    counts = Counter(sample.labels[0] for sample in splits["train"])
    top = max(names, key=lambda name: (counts[name], -names.index(name)))
    val = splits["val"]
    return {"class": top, "val_share": sum(sample.labels[0] == top for sample in val) / len(val)}
