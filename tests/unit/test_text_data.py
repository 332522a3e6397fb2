"""data=text (trainer/data/text.py, trainer/data/corpus.py): the prepared corpus is deterministic and
cached, split by document, packed and bucketed samples have the stated shapes, padding and next-token
shift, the unigram baseline is the hand-computed one, the training loader resumes at the same batch,
and every user mistake is one line naming its key. Tiny corpora of a few KB written in tmp_path."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import assert_resumes_mid_epoch
import trainer.data.corpus as corpus_module
from trainer.data.base import TokenRecord
from trainer.data.corpus import (EXCLUDED_STDLIB, SPLITS, builtin_corpus, cut_documents, split_of, stdlib_files,
                                 unigram_perplexity)
from trainer.data.text import IGNORE_INDEX, LengthGroupedBatches, TextData, main
from trainer.infra.errors import UserError

WORDS = ("the model reads every token of a line and learns which comes next while the loss falls "
         "slowly over many steps of small batches def return import class self value list for in if").split()


def write_corpus(root: Path, files: int = 40, seed: int = 0) -> Path:
    """`files` short text files of seeded random sentences of varied length (a few KB in all), in
    nested folders, with a hidden file and a binary one that must be left out."""
    rng = random.Random(seed)
    for index in range(files):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(rng.randint(1, 12))]
        path = root / f"part{index % 3}" / f"doc{index:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    (root / ".git").mkdir(exist_ok=True)
    (root / ".git" / "hidden.txt").write_text("never read " * 50)
    (root / "blob.bin").write_bytes(bytes(range(256)))
    return root


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


def text_data(root: Path, cache: Path, **keys) -> TextData:
    settings: dict[str, Any] = dict(vocab_size=300, sequence_length=16, batch_size=4, val_fraction=0.2, test_fraction=0.2,
                    num_workers=0)
    settings.update(keys)
    return TextData(root=str(root), cache_dir=str(cache), **settings)


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(batch) for batch in loader]


# -- the prepared corpus ----------------------------------------------------------------------------------
def test_two_prepares_write_the_same_bytes(corpus_dir, tmp_path):
    """The tokenizer is trained deterministically: preparing the same corpus twice (into two caches)
    gives byte-identical tokenizer.json, token files, document offsets and meta.json."""
    first = text_data(corpus_dir, tmp_path / "a").prepared()
    second = text_data(corpus_dir, tmp_path / "b").prepared()
    assert first.folder.name == second.folder.name
    names = sorted(path.name for path in first.folder.iterdir())
    assert names == sorted(path.name for path in second.folder.iterdir())
    assert {"tokenizer.json", "meta.json", "train.tokens", "val.docs.npy"} <= set(names)
    for name in names:
        assert (first.folder / name).read_bytes() == (second.folder / name).read_bytes(), name
    assert first.dtype == np.uint16 and first.meta["vocab_size"] <= 300
    assert int(first.tokens("train").max()) < first.meta["vocab_size"]


def test_a_second_inspect_reads_the_cache_and_another_corpus_gets_its_own(corpus_dir, tmp_path, monkeypatch):
    """The second data module with the same settings neither trains nor writes (the tokenizer's file
    keeps its mtime, training would fail); a changed file (content hash) prepares a new folder."""
    cache = tmp_path / "cache"
    first = text_data(corpus_dir, cache)
    first.inspect()
    tokenizer_file = first.prepared().tokenizer_file
    stamp = tokenizer_file.stat().st_mtime_ns

    def refuse(*args, **kwargs):
        raise AssertionError("trained again instead of reading the cache")

    monkeypatch.setattr(corpus_module, "train_bpe", refuse)
    again = text_data(corpus_dir, cache)
    assert again.inspect() == first.inspect()
    assert again.prepared().folder == first.prepared().folder and tokenizer_file.stat().st_mtime_ns == stamp
    assert not list(cache.glob(".*"))  # no staging folder left behind

    monkeypatch.undo()
    (corpus_dir / "part0" / "doc00.txt").write_text("a changed file\n")
    changed = text_data(corpus_dir, cache).prepared()
    assert changed.folder != first.prepared().folder
    assert len(list(cache.glob("text-*"))) == 2


def test_documents_are_split_by_a_hash_of_their_path(corpus_dir, tmp_path):
    """Every file is one document in exactly one split, the one `split_of` gives its relative path; the
    tokens of a split are its documents' bytes (tokenizer=byte), each after an end-of-text token;
    hidden and non-matching files are not read."""
    prepared = text_data(corpus_dir, tmp_path / "c", tokenizer="byte").prepared()
    files = sorted(p.relative_to(corpus_dir).as_posix() for p in corpus_dir.rglob("*.txt") if ".git" not in p.parts)
    assert prepared.meta["files"] == files
    for split in SPLITS:
        wanted = [(corpus_dir / name).read_bytes() for name in files if split_of(name, 0.2, 0.2) == split]
        tokens, offsets = np.asarray(prepared.tokens(split)), prepared.offsets(split)
        assert tokens[0] == 256 and (tokens[offsets] == 256).all() and offsets[-1] == len(tokens) - 1
        found = [bytes(tokens[a + 1:b].astype(np.uint8)) for a, b in zip(offsets[:-1], offsets[1:])]
        assert found == wanted and wanted, split
    assert prepared.meta["documents"] == {split: sum(split_of(n, 0.2, 0.2) == split for n in files) for split in SPLITS}


def test_a_long_file_is_cut_into_documents_at_line_breaks(monkeypatch):
    """A file longer than DOCUMENT_CHARS becomes pieces name#1, name#2... each ending at a line break,
    together the whole file; a short one stays one document."""
    monkeypatch.setattr(corpus_module, "DOCUMENT_CHARS", 20)
    text = "".join(f"line {i} of the file\n" for i in range(10))
    pieces = list(cut_documents("a.txt", text))
    assert [name for name, _ in pieces] == [f"a.txt#{i}" for i in range(1, len(pieces) + 1)] and len(pieces) > 2
    assert "".join(piece for _, piece in pieces) == text and all(p.endswith("\n") for _, p in pieces)
    assert list(cut_documents("b.txt", "short\n")) == [("b.txt", "short\n")]


def test_the_run_folder_gets_a_tokenizer_that_tokenizers_loads(corpus_dir, tmp_path):
    """inspect copies the tokenizer to RUN_DIR/tokenizer.json, loadable with Tokenizer.from_file and
    encoding a document to the ids in the token file; with tokenizer=byte its ids are the bytes."""
    from tokenizers import Tokenizer

    for mode in ("bpe", "byte"):
        run_dir = tmp_path / f"run-{mode}"
        run_dir.mkdir()
        data = text_data(corpus_dir, tmp_path / "cache", tokenizer=mode)
        data.attach_run(run_dir, seed=0)
        data.inspect()
        tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
        prepared = data.prepared()
        tokens, offsets = np.asarray(prepared.tokens("train")), prepared.offsets("train")
        first = prepared.meta["files"][[split_of(n, 0.2, 0.2) for n in prepared.meta["files"]].index("train")]
        text = (corpus_dir / first).read_text()
        assert tokenizer.encode(text).ids == tokens[offsets[0] + 1:offsets[1]].tolist(), mode
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
        if mode == "byte":
            assert tokenizer.encode(text).ids == list(text.encode()) and tokenizer.get_vocab_size() == 257


def test_inspect_says_what_the_model_needs(corpus_dir, tmp_path):
    """DataInfo of kind tokens: the vocabulary and max_positions, samples of T tokens (16 bytes each:
    int64 inputs and targets), sizes in sequences, the unigram baseline of meta.json."""
    data = text_data(corpus_dir, tmp_path / "cache")
    info = data.inspect()
    meta = data.prepared().meta
    assert info.kind == "tokens" and info.num_classes == 0 and info.record == TokenRecord(meta["vocab_size"], 16)
    assert info.model_inputs() == {"vocab_size": meta["vocab_size"], "max_positions": 16}
    assert info.sample_bytes == 2 * 8 * 16 and info.input_shape() == (16,)
    assert info.sizes == {split: (meta["tokens"][split] - 1) // 16 for split in SPLITS}
    assert info.baselines == {"val/perplexity": meta["unigram_val_perplexity"]}
    assert 1 < info.baselines["val/perplexity"] < meta["vocab_size"] + 1
    assert len(info.notes) == 2 and all("\n" not in note for note in info.notes)


# -- the unigram baseline ---------------------------------------------------------------------------------
def test_the_unigram_baseline_is_the_hand_computed_perplexity():
    """Train tokens [0, 1, 1, 2] in a vocabulary of 4: add-one counts 2, 3, 2, 1 of 8. Validation
    [0, 1, 2, 2] scores its targets 1, 2, 2 (the first token is never predicted):
    exp(-(log 3/8 + 2 log 2/8) / 3)."""
    hand = np.exp(-(np.log(3 / 8) + 2 * np.log(2 / 8)) / 3)
    assert unigram_perplexity(np.array([0, 1, 1, 2], np.uint16), np.array([0, 1, 2, 2], np.uint16), 4) == \
        pytest.approx(hand, rel=1e-12)
    # a uniform unigram model over V tokens scores V
    assert unigram_perplexity(np.arange(5), np.array([0, 1, 2, 3, 4]), 5) == pytest.approx(5.0)


# -- packed sequences -------------------------------------------------------------------------------------
def test_packed_samples_are_consecutive_windows_with_the_next_token_as_target(corpus_dir, tmp_path):
    """Sample i is tokens i*T .. i*T + T - 1, its targets the same window one token on; batches are
    (input_ids, targets) int64 [B, T], passed through finish_batch unchanged; the data sets pickle
    without their memory map and read the same in a loader worker."""
    data = text_data(corpus_dir, tmp_path / "cache")
    data.setup()
    train_set: Any = data.train_set
    tokens = torch.from_numpy(np.asarray(data.prepared().tokens("train")).astype(np.int64))
    for index in (0, 1, len(train_set) - 1):
        inputs, targets = train_set[index]
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (16,)
        assert torch.equal(inputs, tokens[index * 16:index * 16 + 16])
        assert torch.equal(targets, tokens[index * 16 + 1:index * 16 + 17])
    with pytest.raises(IndexError):
        train_set[len(train_set)]
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert data.finish_batch((inputs, targets), training=True) == (inputs, targets)

    assert len(pickle.dumps(train_set)) < 2000  # the path, not the tokens
    worker = text_data(corpus_dir, tmp_path / "cache", num_workers=1, persistent_workers=False)
    worker.setup()
    for (a, b), (c, d) in zip(_batches(data.val_dataloader()), _batches(worker.val_dataloader())):
        assert torch.equal(a, c) and torch.equal(b, d)


# -- bucketed sequences -----------------------------------------------------------------------------------
def test_bucketed_batches_are_length_grouped_and_padded_with_ignored_targets(corpus_dir, tmp_path):
    """sequences=bucketed: each document cut alone into pieces of at most T tokens; a training batch
    holds pieces of neighbouring lengths (every batch's longest at most the next batch's shortest),
    padded to a multiple of 8 (at most T) with 0 in the inputs and -100 in the targets; every
    token of every document is a target exactly once."""
    data = text_data(corpus_dir, tmp_path / "cache", sequences="bucketed", sequence_length=24, tokenizer="byte")
    info = data.inspect()
    data.setup()
    pieces: Any = data.train_set
    assert info.sizes["train"] == len(pieces) and pieces.lengths.min() >= 2 and pieces.lengths.max() == 25
    grouped = LengthGroupedBatches(pieces, 4)
    lengths = pieces.lengths[grouped.batches]
    assert (lengths.max(axis=1)[:-1] <= lengths.min(axis=1)[1:]).all()
    assert len(grouped) == len(pieces) // 4
    # every target token of the training split, once
    offsets = data.prepared().offsets("train")
    assert int((pieces.lengths - 1).sum()) == int(offsets[-1] - offsets[0])

    widths = set()
    for inputs, targets in _batches(data.train_dataloader()):
        assert inputs.shape == targets.shape and inputs.shape[0] == 4
        widths.add(inputs.shape[1])
        assert inputs.shape[1] % 8 == 0 or inputs.shape[1] == 24
        padded = targets == IGNORE_INDEX
        assert (inputs[padded] == 0).all()
        real = (~padded).sum(dim=1)
        assert real.max() > inputs.shape[1] - 8 or inputs.shape[1] == 8  # padded to the longest, no further
        shifted = ~padded[:, 1:]
        assert torch.equal(inputs[:, 1:][shifted], targets[:, :-1][shifted])
    assert len(widths) > 1
    for inputs, targets in _batches(data.val_dataloader()):  # evaluation batches are padded the same way
        assert inputs.shape[1] % 8 == 0 or inputs.shape[1] == 24
        assert (inputs[targets == IGNORE_INDEX] == 0).all()


# -- resuming ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sequences", ["packed", "bucketed"])
def test_the_training_loader_resumes_at_the_same_batch(corpus_dir, tmp_path, sequences):
    """A run stopped after 2 batches of an epoch: a new data module given the sampler's position (the
    train_position of the base class's state_dict) yields that epoch's remaining batches, the same
    tensors; the next epoch's order differs from this one's."""
    def module():
        data = text_data(corpus_dir, tmp_path / "cache", sequences=sequences, tokenizer="byte")
        data.attach_run(None, seed=3)
        data.setup()
        return data

    assert_resumes_mid_epoch(module)


# -- the built-in corpus ----------------------------------------------------------------------------------
def test_the_built_in_corpus_is_the_standard_library_sources_listed_the_same_way_every_time():
    """root=null lists the standard library's .py files (no tests, site-packages, idlelib, ...), sorted,
    whole files up to max_corpus_mb; the same list and content hash on every call. Only listed and
    hashed here, never tokenized."""
    first, second = builtin_corpus(2.0), builtin_corpus(2.0)
    assert first == second and first.fingerprint() == second.fingerprint()
    assert list(first.files) == sorted(first.files) and all(name.endswith(".py") for name in first.files)
    assert not any(set(Path(name).parts[:-1]) & EXCLUDED_STDLIB for name in first.files)
    assert sum((first.root / name).stat().st_size for name in first.files) <= 2e6
    root, everything = stdlib_files()
    assert root == first.root and set(first.files) < set(everything)
    assert "os.py" in everything and not any(name.startswith(("test/", "idlelib/")) for name in everything)
    assert set(first.files) <= set(builtin_corpus(4.0).files)  # a larger cap keeps these and adds others
    assert "standard library" in first.description and first.key == "data.max_corpus_mb"


# -- one-line errors --------------------------------------------------------------------------------------
def _error(make) -> UserError:
    with pytest.raises(UserError) as caught:
        make()
    assert "\n" not in str(caught.value)
    return caught.value


def test_each_mistake_is_one_line_naming_its_key(tmp_path, corpus_dir):
    """An empty folder, a folder without matching files, no such folder, a corpus too small for one
    training batch, a BPE vocabulary below 257, a glob without a root, and an empty split each stop
    in one line naming the data.* key and what is allowed."""
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _error(lambda: text_data(empty, tmp_path / "c").inspect()).where == "data.root"
    assert _error(lambda: text_data(tmp_path / "missing", tmp_path / "c").inspect()).where == "data.root"
    unmatched = _error(lambda: text_data(corpus_dir, tmp_path / "c", glob="*.csv").inspect())
    assert unmatched.where == "data.glob" and "*.csv" in unmatched.problem
    only_binary = tmp_path / "binary"
    only_binary.mkdir()
    (only_binary / "a.bin").write_bytes(b"\0" * 10)
    assert _error(lambda: text_data(only_binary, tmp_path / "c").inspect()).where == "data.root"

    small = write_corpus(tmp_path / "small", files=12)
    too_small = _error(lambda: text_data(small, tmp_path / "c", batch_size=1000).inspect())
    assert too_small.where == "data.root" and "fewer than one batch" in too_small.problem

    vocab = _error(lambda: text_data(corpus_dir, tmp_path / "c", vocab_size=256))
    assert vocab.where == "data.vocab_size" and "257" in str(vocab.allowed)
    text_data(corpus_dir, tmp_path / "c", vocab_size=100, tokenizer="byte")  # ignored for bytes
    assert _error(lambda: TextData(root=None, glob="*.txt")).where == "data.glob"

    one_file = tmp_path / "one"
    one_file.mkdir()
    (one_file / "only.txt").write_text("a single short document\n")
    assert _error(lambda: text_data(one_file, tmp_path / "c").inspect()).where in (
        "data.root", "data.val_fraction", "data.test_fraction")


def test_the_command_line_prepares_the_cache_a_run_reads(corpus_dir, tmp_path, capsys):
    """python -m trainer.data.text --root DIR writes the cache folder that a data module with the same
    settings then reads, and says what it wrote."""
    cache = tmp_path / "cache"
    assert main(["--root", str(corpus_dir), "--vocab-size", "300", "--val-fraction", "0.2", "--test-fraction", "0.2",
                 "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    folder = next(cache.glob("text-*"))
    assert f"written: {folder}" in out and "unigram perplexity on val" in out
    assert text_data(corpus_dir, cache).prepared().folder == folder
