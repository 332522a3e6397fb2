"""The text a language model learns from, from files to token arrays kept in a cache (data=text).

A corpus is a folder or the Python standard library's own sources. A document is a file, or a piece
of about `DOCUMENT_CHARS` of a longer one cut at a line break (so one long file still reaches every
split), and goes to train, val or test by a hash of its name. `prepare` trains the tokenizer on the
training documents only, encodes every split into one flat token file, and keeps the result in a
folder named by everything that shapes it, renamed into place once whole. Free of torch: the data
module (trainer/data/text.py) reads what is written here."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import secrets
import shutil
import sysconfig
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Optional, TypeVar

import numpy as np

from trainer.infra.errors import UserError
from trainer.infra.extras import require

#: Bump when the way the arrays are made changes: older cache folders are then not read.
RECIPE_VERSION = 1
SPLITS = ("train", "val", "test")
#: Appended between documents (and before the first), so the model learns where a text ends; in
#: bucketed mode it starts every document, as a beginning-of-text token would.
END_OF_TEXT = "<|endoftext|>"
#: What a folder's files must match when `data.glob` is not given.
DEFAULT_PATTERNS = ("*.txt", "*.md", "*.py", "*.rst")
#: A longer file is cut at the first line break past each multiple of this many characters.
DOCUMENT_CHARS = 65_536
#: Folders of the standard library left out of the built-in corpus: installed packages, test suites
#: (generated data and huge literals), tools and demos, vendored wheels, and the codecs' tables.
EXCLUDED_STDLIB = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
                             "ensurepip", "encodings", "pydoc_data", "__pycache__", "venv"})
#: Documents encoded per call of the tokenizer (bounds the memory of preparing a large corpus).
ENCODE_CHUNK = 256


@dataclass(frozen=True)
class Corpus:
    """Files under `root` (relative POSIX paths, sorted) and a line that says what they are;
    `key` is the config key an error about the corpus names."""

    root: Path
    files: tuple[str, ...]
    description: str
    key: str

    def documents(self, val_fraction: float, test_fraction: float) -> Iterator[tuple[str, str]]:
        """(split, text) of every document, in the files' order; blank ones are left out."""
        for relative in self.files:
            text = self.read(relative).decode("utf-8", errors="replace")
            for name, piece in cut_documents(relative, text):
                if piece.strip():
                    yield split_of(name, val_fraction, test_fraction), piece

    def read(self, relative: str) -> bytes:
        try:
            return (self.root / relative).read_bytes()
        except OSError as ex:
            raise UserError(self.key, f"cannot read {self.root / relative}: {ex.strerror}", "readable files") from None

    def fingerprint(self) -> str:
        """A hash of every file's name and bytes: another corpus never reuses a cache."""
        digest = hashlib.sha256()
        for relative in self.files:
            data = self.read(relative)
            digest.update(f"{relative}\0{len(data)}\0".encode())
            digest.update(data)
        return digest.hexdigest()


def cut_documents(name: str, text: str) -> Iterator[tuple[str, str]]:
    """(document name, text): the whole file, or pieces ``name#1``, ``name#2``... of a long one."""
    if len(text) <= DOCUMENT_CHARS:
        yield name, text
        return
    start, part = 0, 0
    while start < len(text):
        end = text.find("\n", start + DOCUMENT_CHARS)
        end = len(text) if end < 0 else end + 1
        part += 1
        yield f"{name}#{part}", text[start:end]
        start = end


def _unit_hash(text: str) -> float:
    """A number in [0, 1) that follows from `text` alone."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def split_of(name: str, val_fraction: float, test_fraction: float) -> str:
    """The split of the document `name`: a hash of the name, not a random draw, so that adding a
    file never moves another one between splits."""
    u = _unit_hash(f"split\0{name}")
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


# -- where the text comes from ---------------------------------------------------------------------
def folder_corpus(root: str, pattern: Optional[str]) -> Corpus:
    """The files of `root` matching `pattern` (null: `DEFAULT_PATTERNS`) in any subfolder; hidden
    files and folders (.git, .venv) are left out."""
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise UserError("data.root", f"'{root}' is not a folder", "a folder of text files, or null for the "
                        "built-in corpus (the Python standard library's sources)")
    everything = [path for path in folder.rglob("*")
                  if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)]
    if not everything:
        raise UserError("data.root", f"'{root}' holds no files", "a folder of text files")
    patterns = (pattern,) if pattern else DEFAULT_PATTERNS
    files = sorted({path.relative_to(folder).as_posix() for path in everything
                    if any(path.relative_to(folder).match(p) for p in patterns)})
    if not files:
        raise UserError("data.glob" if pattern else "data.root",
                        f"none of the {len(everything)} files in '{root}' matches {', '.join(patterns)}",
                        "a data.glob that matches the text files (e.g. '*.txt')")
    size = sum((folder / name).stat().st_size for name in files)
    return Corpus(folder, tuple(files), f"{folder}: {len(files)} files, {size / 1e6:.2f} MB", "data.root")


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library's folder and its `.py` sources (relative, sorted), less `EXCLUDED_STDLIB`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if not any(part in EXCLUDED_STDLIB or part.startswith("config-")
                              for part in path.relative_to(root).parts[:-1]))
    return root, files


def builtin_corpus(max_mb: Optional[float]) -> Corpus:
    """The standard library's sources up to `max_mb` (null: all). The cap keeps whole files in the
    order of a hash of their names: a sample across the whole library rather than the modules
    that sort first (alphabetical order would stop in the middle of the alphabet). The same
    Python version gives the same files."""
    root, files = stdlib_files()
    sizes = {name: (root / name).stat().st_size for name in files}
    budget = math.inf if max_mb is None else max_mb * 1e6
    kept, total = [], 0
    for name in sorted(files, key=lambda name: _unit_hash(f"order\0{name}")):
        if total + sizes[name] > budget:
            break
        kept.append(name)
        total += sizes[name]
    if not kept:
        raise UserError("data.max_corpus_mb", f"{max_mb} MB holds no file of the standard library",
                        "at least 0.1 (MB), or null for all of it")
    whole = sum(sizes.values())
    return Corpus(root, tuple(sorted(kept)), f"the Python {platform.python_version()} standard library: "
                  f"{len(kept)} of {len(files)} .py files, {total / 1e6:.2f} of {whole / 1e6:.2f} MB", "data.max_corpus_mb")


# -- tokenizers ------------------------------------------------------------------------------------
def byte_symbols() -> list[str]:
    """The printable character standing for each byte in a byte-level vocabulary (GPT-2's table,
    which `tokenizers`' ByteLevel pre-tokenizer uses): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    others = {byte: chr(256 + n) for n, byte in enumerate(sorted(set(range(256)) - printable))}
    return [chr(byte) if byte in printable else others[byte] for byte in range(256)]


def _byte_level(model: Any) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_tokenizer() -> Any:
    """A `tokenizers` model whose ids are the bytes of the text (no merges) and 256 the end of a
    text: what `tokenizers.Tokenizer.from_file` loads for generation, though preparing encodes
    bytes directly."""
    from tokenizers import models

    tokenizer = _byte_level(models.BPE(vocab={symbol: byte for byte, symbol in enumerate(byte_symbols())}, merges=[]))
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def train_bpe(documents: Iterable[str], vocab_size: int) -> Any:
    """Byte-level BPE trained on `documents`: id 0 the end of a text, then the 256 byte symbols, then
    the merges, up to `vocab_size` (fewer when the corpus has no more pairs to merge). Deterministic:
    the same documents give the same merges in any process (tests/unit/test_text_data.py)."""
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def encode(tokenizer: Any, byte_ids: bool, texts: list[str]) -> list[np.ndarray]:
    """Each text's token ids, the end-of-text id not included. (`tokenizers` would also turn a
    literal "<|endoftext|>" inside a text into that token, as GPT-2's tokenizer does.)"""
    if byte_ids:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
    return [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


# -- the prepared folder ---------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenSettings:
    """What shapes the token arrays besides the corpus (the cache key holds both)."""

    tokenizer: str
    vocab_size: int
    val_fraction: float
    test_fraction: float


@dataclass(frozen=True)
class CacheFolder:
    """A folder of the cache (`write_cached`): its files and ``meta.json``, which says what they are."""

    folder: Path
    meta: dict[str, Any]

    @classmethod
    def read(cls: type[C], folder: Path) -> Optional[C]:
        try:
            return cls(folder, json.loads((folder / "meta.json").read_text()))
        except (OSError, ValueError):
            return None  # not made yet, or unreadable: made again

    @property
    def tokenizer_file(self) -> Path:
        return self.folder / "tokenizer.json"


C = TypeVar("C", bound=CacheFolder)


class Prepared(CacheFolder):
    """A prepared corpus: per split ``{split}.tokens`` (the token ids, flat, one end-of-text before
    every document and after the last) and ``{split}.docs.npy`` (the positions of those end-of-text
    tokens: document d spans ``offsets[d] .. offsets[d + 1]``), ``tokenizer.json`` and ``meta.json``."""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def token_file(self, split: str) -> Path:
        return self.folder / f"{split}.tokens"

    def tokens(self, split: str) -> np.ndarray:
        return np.memmap(self.token_file(split), dtype=self.dtype, mode="r")

    def offsets(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.docs.npy")


def keyed_folder(cache_dir: Path, prefix: str, key: dict[str, Any]) -> Path:
    """The cache folder named by a hash of `key`, everything that shapes what it holds."""
    text = json.dumps(key, sort_keys=True)
    return cache_dir / f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def cache_folder(cache_dir: Path, corpus_hash: str, settings: TokenSettings) -> Path:
    return keyed_folder(cache_dir, "text", {"version": RECIPE_VERSION, "corpus": corpus_hash,
                                            "document_chars": DOCUMENT_CHARS, **settings.__dict__})


def prepare(corpus: Corpus, settings: TokenSettings, cache_dir: Path) -> Prepared:
    """The prepared corpus from the cache, or made now and cached."""
    corpus_hash = corpus.fingerprint()
    folder = cache_folder(cache_dir, corpus_hash, settings)
    found = Prepared.read(folder)
    if found is not None:
        return found
    require("text", "data=text")  # the byte tokenizer too: generation loads its tokenizer.json
    return write_cached(Prepared, folder, "the prepared corpus", partial(_make, corpus, settings, corpus_hash))


def write_cached(kind: type[C], folder: Path, what: str, make: Callable[[Path], dict[str, Any]]) -> C:
    """Make the cache folder `folder`: `make` writes the files into a staging folder and returns what
    meta.json says, which is written last (it marks a folder done); the staging folder is then
    renamed into place, so that a crash or a second process never sees half of it. `what` names
    the folder in an error."""
    cache_dir = folder.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # Not tempfile.mkdtemp: its folder is private (0700), and a cache may be shared by a team.
        staging = cache_dir / f".{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        staging.mkdir()
    except OSError as ex:
        raise UserError("data.cache_dir", f"cannot write {what} to {cache_dir}: {ex}", "a writable folder") from None
    try:
        meta = make(staging)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _publish(staging, folder)
    except OSError as ex:  # the source's own files are read by Corpus.read, which names them
        raise UserError("data.cache_dir", f"cannot write {what} to {cache_dir}: {ex}",
                        "a writable folder with room for it") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    made = kind.read(folder)
    assert made is not None, folder
    return made


def _publish(staging: Path, folder: Path) -> None:
    """Rename the finished `staging` folder to `folder`. Another process preparing the same corpus
    (each rank of a multi-GPU run) may have got there first: its folder is the same, and kept."""
    for path in staging.iterdir():  # the rename is durable only once the data are
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if folder.exists() and CacheFolder.read(folder) is None:
        shutil.rmtree(folder, ignore_errors=True)  # its meta.json is unreadable (damaged, edited by hand)
    try:
        os.rename(staging, folder)
    except OSError:
        if CacheFolder.read(folder) is None:
            raise


def _make(corpus: Corpus, settings: TokenSettings, corpus_hash: str, out: Path) -> dict[str, Any]:
    """Write the tokenizer and the token files of every split into `out`; what meta.json says."""
    def documents() -> Iterator[tuple[str, str]]:
        return corpus.documents(settings.val_fraction, settings.test_fraction)

    byte_ids = settings.tokenizer == "byte"
    tokenizer = (byte_tokenizer() if byte_ids
                 else train_bpe((text for split, text in documents() if split == "train"), settings.vocab_size))
    # Loader workers forked after the tokenizer used its threads would each warn that tokenizers'
    # parallelism is now off; they never tokenize, so say so once (a person's own setting stands).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer.save(str(out / "tokenizer.json"))
    vocab_size = int(tokenizer.get_vocab_size())
    end_of_text = int(tokenizer.token_to_id(END_OF_TEXT))
    dtype = np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)
    counts = _write_splits(documents(), lambda texts: encode(tokenizer, byte_ids, texts), end_of_text, dtype, out)
    _check_splits(corpus, settings, counts)
    tokens = {split: int(os.path.getsize(out / f"{split}.tokens") // dtype.itemsize) for split in SPLITS}
    baseline = unigram_perplexity(np.fromfile(out / "train.tokens", dtype), np.fromfile(out / "val.tokens", dtype),
                                  vocab_size)
    return {"version": RECIPE_VERSION, "corpus": corpus.description, "files": list(corpus.files),
            "tokenizer": settings.tokenizer, "vocab_size_asked": settings.vocab_size, "vocab_size": vocab_size,
            "end_of_text": end_of_text, "dtype": dtype.name, "documents": counts, "tokens": tokens,
            "val_fraction": settings.val_fraction, "test_fraction": settings.test_fraction,
            "unigram_val_perplexity": baseline, "corpus_hash": corpus_hash}


def _write_splits(documents: Iterable[tuple[str, str]], encoder: Any, end_of_text: int, dtype: np.dtype,
                  out: Path) -> dict[str, int]:
    """Encode the documents chunk by chunk into each split's token file; the documents per split."""
    files = {split: open(out / f"{split}.tokens", "wb") for split in SPLITS}
    writers = {split: _SplitWriter(files[split], end_of_text, dtype) for split in SPLITS}
    pending: dict[str, list[str]] = {split: [] for split in SPLITS}
    try:
        for split, text in documents:
            pending[split].append(text)
            if len(pending[split]) == ENCODE_CHUNK:
                writers[split].write(encoder(pending[split]))
                pending[split] = []
        for split in SPLITS:
            writers[split].write(encoder(pending[split]) if pending[split] else [])
    finally:
        for f in files.values():
            f.close()
    for split in SPLITS:
        np.save(out / f"{split}.docs.npy", np.asarray(writers[split].offsets, dtype=np.int64))
    return {split: len(writers[split].offsets) - 1 for split in SPLITS}


class _SplitWriter:
    """Appends documents to one split's token file, each followed by the end-of-text id."""

    def __init__(self, file: BinaryIO, end_of_text: int, dtype: np.dtype) -> None:
        self.file, self.end_of_text, self.dtype = file, end_of_text, dtype
        np.asarray([end_of_text], dtype=dtype).tofile(file)
        self.offsets = [0]
        self.length = 1

    def write(self, documents: list[np.ndarray]) -> None:
        if not documents:
            return
        pieces = []
        for ids in documents:
            pieces += [ids, np.asarray([self.end_of_text])]
            self.length += len(ids) + 1
            self.offsets.append(self.length - 1)
        np.concatenate(pieces).astype(self.dtype).tofile(self.file)


def _check_splits(corpus: Corpus, settings: TokenSettings, counts: dict[str, int]) -> None:
    total = sum(counts.values())
    if total == 0:
        raise UserError(corpus.key, f"the corpus ({corpus.description}) holds no text", "files with text in them")
    for split, key in (("train", corpus.key), ("val", "data.val_fraction"), ("test", "data.test_fraction")):
        if counts[split] == 0:
            raise UserError(key, f"none of the corpus's {total} documents fell in the {split} split (a file is a "
                            f"document, a long one is cut into {DOCUMENT_CHARS // 1024} KiB documents)",
                            "more files, or a larger fraction for that split")


def unigram_perplexity(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """The perplexity on the validation tokens of a unigram model fitted on the training tokens with
    add-one smoothing: what a model that learned only the tokens' frequencies scores. The tokens
    evaluated are those a model predicts (every one but the split's first)."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)
    targets = np.bincount(np.asarray(val[1:], dtype=np.int64), minlength=vocab_size)
    return float(math.exp(-(targets * log_p).sum() / max(1, targets.sum())))
