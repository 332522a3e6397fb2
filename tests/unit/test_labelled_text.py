"""data=text_classification (trainer/data/labelled_text.py, trainer/data/labelled_corpus.py): every
source form gives the samples, splits and classes it holds, split by a hash of the text; batches are
``(ids, labels)`` padded to a multiple of 8 (at most max_length) with [CLS] ... [SEP] rows; the
truncation is counted, the cache reused, a given tokenizer.json used with its own ids, the training
order resumed mid-epoch, and every bad input stopped in one line. Small sets written in tmp_path;
the built-in set built once at its default cap (module fixture)."""

from __future__ import annotations

import csv
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import assert_resumes_mid_epoch
import trainer.data.labelled_corpus as corpus_module
from trainer.data.base import SequenceRecord
from trainer.data.corpus import SPLITS, split_of
from trainer.data.labelled_corpus import (BUILTIN_CHARS, BUILTIN_PACKAGES, BUILTIN_PER_CLASS, MIN_SNIPPET_CHARS,
                                          Columns, builtin_samples, open_source, split_samples)
from trainer.data.labelled_text import LabelledTextData, PadSequences
from trainer.data.text import LengthGroupedBatches
from trainer.infra.errors import UserError

#: Each class draws its words from its own pool, so the classes are told apart by their words.
POOLS = {
    "apple": "fruit orchard ripe juice tree sweet harvest peel seed core crisp".split(),
    "river": "water flow bank bridge stream current fish boat delta flood shore".split(),
    "train": "rail track station engine carriage ticket platform signal steam late".split(),
}
MAX_LENGTH = 20  # not a multiple of 8: the widest batch is cut to it


def text_of(label: str, index: int) -> str:
    """A seeded sentence of 1 to 30 words of the class's pool (some longer than MAX_LENGTH tokens)."""
    rng = random.Random(f"{label}-{index}")
    return " ".join(rng.choice(POOLS[label]) for _ in range(rng.randint(1, 30))) + f" {index}."


def write_folders(root: Path, per_class: int = 20, classes: tuple[str, ...] = tuple(POOLS)) -> Path:
    for label in classes:
        (root / label).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            (root / label / f"{index:03d}.txt").write_text(text_of(label, index))
    (root / "apple" / ".hidden.txt").write_text("never read")
    (root / "apple" / "notes.md").write_text("not a sample")
    return root


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def labelled_rows(count: int = 60) -> list[tuple[str, str]]:
    labels = list(POOLS)
    return [(text_of(labels[i % 3], i), labels[i % 3]) for i in range(count)]


def data(source: Any, tmp_path: Path, **keys: Any) -> LabelledTextData:
    settings: dict[str, Any] = dict(vocab_size=200, max_length=MAX_LENGTH, batch_size=4, val_fraction=0.2,
                                    test_fraction=0.2, num_workers=0, cache_dir=str(tmp_path / "cache"))
    settings.update(keys)
    return LabelledTextData(source=None if source is None else str(source), **settings)


def expected_splits(texts_labels: list[tuple[str, Any]], val: float = 0.2, test: float = 0.2) -> dict[str, list]:
    """The samples of each split in source order, as the hash of each text puts them."""
    splits: dict[str, list] = {split: [] for split in SPLITS}
    for text, label in texts_labels:
        splits[split_of(text, val, test)].append((text, label))
    return splits


def _batches(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(batch) for batch in loader]


def _error(make) -> UserError:
    with pytest.raises(UserError) as caught:
        make()
    assert "\n" not in str(caught.value)
    return caught.value


# -- sources ----------------------------------------------------------------------------------------------
def test_class_folders_give_their_files_split_by_a_hash_of_the_text(tmp_path):
    """<label>/*.txt: each file one sample (hidden and non-.txt files left out), the classes sorted,
    each split the files split_of puts there in file order, with their labels; every row is [CLS] +
    the tokens of the run folder's tokenizer + [SEP], padded with [PAD] 0."""
    from tokenizers import Tokenizer

    root = write_folders(tmp_path / "folders")
    module = data(root, tmp_path)
    run_dir = tmp_path / "run"
    module.attach_run(run_dir, seed=0)
    info = module.inspect()
    assert info.num_classes == 3 and info.class_names == ["apple", "river", "train"]
    files = sorted((p.parent.name, p) for p in root.glob("*/*.txt") if not p.name.startswith("."))
    wanted = expected_splits([(p.read_text(), info.class_names.index(label)) for label, p in files])
    prepared = module.prepared()
    assert info.sizes == {split: len(wanted[split]) for split in SPLITS} and sum(info.sizes.values()) == 60
    assert all(info.sizes[split] > 3 for split in SPLITS)
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    for split in SPLITS:
        assert prepared.labels(split).tolist() == [label for _, label in wanted[split]], split
        rows, lengths = prepared.ids(split), prepared.lengths(split)
        assert rows.shape == (len(wanted[split]), MAX_LENGTH)
        for row, length, (text, _) in zip(rows, lengths, wanted[split]):
            assert row[:length].tolist() == tokenizer.encode(text).ids  # the served tokenizer encodes as the data
            assert row[0] == 2 and row[length - 1] == 3 and (row[length:] == 0).all()
    assert [tokenizer.id_to_token(i) for i in range(4)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def test_split_folders_are_the_splits_and_a_missing_test_is_val(tmp_path):
    """train/, val/, test/ of class folders are the splits as they are (the fractions unused); without
    test/, the test split is val/ and a note says so."""
    root = tmp_path / "splits"
    for split, count in (("train", 12), ("val", 5), ("test", 4)):
        write_folders(root / split, per_class=count)
    info = data(root, tmp_path).inspect()
    assert info.sizes == {"train": 36, "val": 15, "test": 12}
    assert "train/ and val/ folders, test/" in info.notes[1]

    import shutil
    shutil.rmtree(root / "test")
    module = data(root, tmp_path)
    info = module.inspect()
    assert info.sizes == {"train": 36, "val": 15, "test": 15} and "test/ is val/" in info.notes[1]
    prepared = module.prepared()
    assert np.array_equal(prepared.ids("test"), prepared.ids("val"))


def test_jsonl_single_label_with_integer_labels_in_numeric_order(tmp_path):
    """A .jsonl of {"text", "label"} objects, blank lines skipped: integer labels are classes in
    numeric order (2 before 10), labels int64 [N] in batches; the record is single-label."""
    rows = [{"text": text_of(label, i), "label": {"apple": 10, "river": 2, "train": 1}[label], "id": i}
            for i, (_, label) in enumerate(labelled_rows())]
    path = write_jsonl(tmp_path / "set.jsonl", rows)
    path.write_text(path.read_text().replace("\n", "\n\n", 3))
    module = data(path, tmp_path)
    info = module.inspect()
    assert info.class_names == ["1", "2", "10"] and info.record == SequenceRecord(
        info.record.vocab_size, MAX_LENGTH, pad_id=0, multi_label=False)
    wanted = expected_splits([(row["text"], ["1", "2", "10"].index(str(row["label"]))) for row in rows])
    for split in SPLITS:
        assert module.prepared().labels(split).tolist() == [label for _, label in wanted[split]]
    module.setup()
    ids, labels = next(iter(module.train_dataloader()))
    assert labels.dtype == torch.int64 and labels.shape == (4,) and ids.dtype == torch.int64


def test_jsonl_with_a_list_label_is_multi_label(tmp_path):
    """A label that is a list makes the set multi-label: a plain label counts as a list of one, an
    empty list is no label, a blank one is dropped; labels are float32 multi-hot [N, C]; no
    majority-class baseline."""
    rows = [{"text": text, "label": [label, "river", " "] if i % 4 == 0 else [] if i % 4 == 1 else label}
            for i, (text, label) in enumerate(labelled_rows())]
    module = data(write_jsonl(tmp_path / "multi.jsonl", rows), tmp_path)
    info = module.inspect()
    assert info.record.multi_label and info.class_names == ["apple", "river", "train"] and info.baselines == {}
    names = info.class_names

    def hot(label: Any) -> list[int]:
        labels = set(label) if isinstance(label, list) else {label}
        return [int(name in labels) for name in names]

    wanted = expected_splits([(row["text"], hot(row["label"])) for row in rows])
    for split in SPLITS:
        assert module.prepared().labels(split).tolist() == [label for _, label in wanted[split]]
    module.setup()
    ids, labels = next(iter(module.val_dataloader()))
    assert labels.dtype == torch.float32 and labels.shape == (4, 3) and set(labels.unique().tolist()) <= {0.0, 1.0}
    assert info.sample_bytes == 8 * MAX_LENGTH + 4 * 3


def test_csv_named_columns_and_a_label_separator(tmp_path):
    """A .csv with its own column names (data.text_column, data.label_column), a quoted cell over two
    lines; with data.label_separator a cell holds several labels (multi-label)."""
    rows = labelled_rows()
    path = tmp_path / "set.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "review", "sentiment"])
        for i, (text, label) in enumerate(rows):
            writer.writerow([i, text.replace(" ", "\n", 1) if i == 0 else text, label])
    module = data(path, tmp_path, text_column="review", label_column="sentiment")
    info = module.inspect()
    assert info.class_names == ["apple", "river", "train"] and not info.record.multi_label
    texts = [text.replace(" ", "\n", 1) if i == 0 else text for i, (text, _) in enumerate(rows)]
    wanted = expected_splits([(text, info.class_names.index(label)) for text, (_, label) in zip(texts, rows)])
    assert info.sizes == {split: len(wanted[split]) for split in SPLITS}
    assert module.prepared().labels("train").tolist() == [label for _, label in wanted["train"]]

    multi = tmp_path / "multi.csv"
    multi.write_text("text,label\n" + "".join(f"{text},{label}|river| \n" if i % 2 else f"{text},{label}\n"
                                              for i, (text, label) in enumerate(rows)))
    info = data(multi, tmp_path, label_separator="|").inspect()
    assert info.record.multi_label and info.class_names == ["apple", "river", "train"]


def test_the_split_follows_the_text_not_the_order(tmp_path):
    """Reordering the rows and adding one moves no sample to another split."""
    rows = labelled_rows()
    first = open_source(str(write_jsonl(tmp_path / "a.jsonl", [{"text": t, "label": y} for t, y in rows])))
    shuffled = rows[::-1] + [("a sample added later", "river")]
    second = open_source(str(write_jsonl(tmp_path / "b.jsonl", [{"text": t, "label": y} for t, y in shuffled])))

    def split_of_text(source) -> dict[str, str]:
        samples, _ = source.read(Columns())
        return {sample.text: split for split, kept in split_samples(source, samples, 0.2, 0.2).items()
                for sample in kept}

    before, after = split_of_text(first), split_of_text(second)
    assert len(after) == len(before) + 1 and all(after[text] == split for text, split in before.items())
    assert set(before.values()) == set(SPLITS)


# -- batches ----------------------------------------------------------------------------------------------
def test_batches_are_padded_to_a_multiple_of_8_at_most_max_length(tmp_path):
    """Training batches: ids int64 [4, W], W the longest row rounded up to 8 (at most 20), rows
    [CLS] ... [SEP] then [PAD]; batches group similar lengths; a batch equals the per-sample collate of
    its samples. Val batches follow the rows in order of length, one epoch covering the split once."""
    module = data(write_folders(tmp_path / "folders", per_class=30), tmp_path)
    module.inspect()
    module.setup()
    train: Any = module.train_set
    grouped = LengthGroupedBatches(train, 4)
    lengths = train.lengths[grouped.batches]
    assert (lengths.max(axis=1)[:-1] <= lengths.min(axis=1)[1:]).all() and len(grouped) == len(train) // 4
    widths = set()
    for ids, labels in _batches(module.train_dataloader()):
        real = (ids != 0).sum(dim=1)
        width = ids.shape[1]
        widths.add(width)
        assert ids.shape[0] == 4 and ids.dtype == labels.dtype == torch.int64 and labels.shape == (4,)
        assert width == min(-(-int(real.max()) // 8) * 8, MAX_LENGTH)
        assert (ids[:, 0] == 2).all() and (ids[torch.arange(4), real - 1] == 3).all()
        assert (ids[torch.arange(width)[None, :] >= real[:, None]] == 0).all()
    assert widths == {8, 16, 20}
    index = grouped.batches[3]
    ids, labels = grouped[3]
    per_sample = PadSequences(0, MAX_LENGTH)([train[int(i)] for i in index])
    assert torch.equal(ids, per_sample[0]) and torch.equal(labels, per_sample[1])

    seen = []
    for batch in _batches(module.val_dataloader()):
        assert batch[0].shape[1] % 8 == 0 or batch[0].shape[1] == MAX_LENGTH
        seen += (batch[0] != 0).sum(dim=1).tolist()
    assert seen == sorted(seen) and len(seen) == module.inspect().sizes["val"]
    assert module.variable_shapes and module.finish_batch(batch, training=True) == batch


def test_truncation_is_counted_per_split(tmp_path):
    """A text of more than max_length - 2 tokens is cut to [CLS] + max_length - 2 tokens + [SEP];
    meta and the notes count those per split, as a tokenizer without truncation finds them."""
    from tokenizers import Tokenizer

    module = data(write_folders(tmp_path / "folders"), tmp_path)
    info = module.inspect()
    prepared = module.prepared()
    tokenizer = Tokenizer.from_file(str(prepared.tokenizer_file))
    tokenizer.no_truncation()
    root = tmp_path / "folders"
    texts = expected_splits([(p.read_text(), None) for p in sorted(root.glob("*/*.txt"))
                             if not p.name.startswith(".")])
    for split in SPLITS:
        long = [len(tokenizer.encode(text, add_special_tokens=False).ids) > MAX_LENGTH - 2 for text, _ in texts[split]]
        assert prepared.meta["truncated"][split] == sum(long) and 0 < sum(long) < len(long), split
        assert (prepared.lengths(split)[np.asarray(long)] == MAX_LENGTH).all()
        assert f"{split} {sum(long)} of {len(long)}" in info.notes[2]


def test_the_training_order_resumes_mid_epoch(tmp_path):
    """Stopped after 2 batches of epoch 1, a new module given the sampler's position (the base class's
    state) yields the rest of that epoch, the same tensors; the next epoch's order differs."""
    root = write_folders(tmp_path / "folders", per_class=20)

    def module() -> LabelledTextData:
        made = data(root, tmp_path)
        made.attach_run(None, seed=3)
        made.setup()
        return made

    assert_resumes_mid_epoch(module)


# -- the cache and the tokenizer --------------------------------------------------------------------------
def test_a_second_inspect_reads_the_cache(tmp_path, monkeypatch):
    """The same source and settings: no tokenizer trained, no text encoded, the same folder; a changed
    file or setting: a folder of its own; no staging folder left behind."""
    root = write_folders(tmp_path / "folders")
    first = data(root, tmp_path)
    info = first.inspect()
    folder = first.prepared().folder

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again instead of reading the cache")

    monkeypatch.setattr(corpus_module, "train_wordpiece", refuse)
    monkeypatch.setattr(corpus_module, "encode_texts", refuse)
    again = data(root, tmp_path)
    assert again.inspect() == info and again.prepared().folder == folder
    monkeypatch.undo()
    (root / "river" / "000.txt").write_text("a changed text")
    assert data(root, tmp_path).prepared().folder != folder
    assert data(root, tmp_path, max_length=24).prepared().folder not in (folder, data(root, tmp_path).prepared().folder)
    cache = tmp_path / "cache"
    assert len(list(cache.glob("labels-*"))) == 3 and not list(cache.glob(".*"))


def _tokenizer_file(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = [text_of(label, i) for label in POOLS for i in range(10)]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=150, special_tokens=specials,
                                                                   show_progress=False))
    tokenizer.save(str(path))
    return path


def test_a_given_tokenizer_json_is_used_with_its_own_ids(tmp_path):
    """data.tokenizer=PATH: its vocabulary (vocab_size ignored) and its [PAD], [CLS], [SEP] ids (3, 1,
    2 here), in the rows, the record and the model's inputs; the run folder's copy encodes as the data."""
    from tokenizers import Tokenizer

    given = _tokenizer_file(tmp_path / "tokenizer.json", ["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    module = data(write_folders(tmp_path / "folders"), tmp_path, tokenizer=str(given), vocab_size=9999)
    module.attach_run(tmp_path / "run", seed=0)
    info = module.inspect()
    vocab = Tokenizer.from_file(str(given)).get_vocab_size()
    assert info.record == SequenceRecord(vocab, MAX_LENGTH, pad_id=3, multi_label=False)
    assert info.model_inputs() == {"num_classes": 3, "vocab_size": vocab, "max_positions": MAX_LENGTH,
                                   "pad_token_id": 3}
    module.setup()
    ids, _ = next(iter(module.val_dataloader()))
    real = (ids != 3).sum(dim=1)
    assert (ids[:, 0] == 1).all() and (ids[torch.arange(len(ids)), real - 1] == 2).all() and (ids == 3).any()
    served = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    train: Any = module.train_set
    encoded = {tuple(served.encode(p.read_text()).ids) for p in (tmp_path / "folders").glob("*/[0-9]*.txt")}
    assert all(tuple(train[i][0].tolist()) in encoded for i in range(len(train)))
    assert "tokenizer " + str(given) in info.notes[1]


# -- the built-in set -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin() -> list:
    return builtin_samples()


def test_the_built_in_set_is_balanced_and_the_same_every_time(builtin):
    """Every package gives BUILTIN_PER_CLASS snippets on this Python (the docstring's 1/8 majority
    share); each of 80 to 2,000 characters, from its package's folder, no text twice; a smaller cap keeps
    the first snippets of the same order, call after call."""
    counts = Counter(sample.labels[0] for sample in builtin)
    assert counts == {package: BUILTIN_PER_CLASS for package in BUILTIN_PACKAGES}
    assert all(MIN_SNIPPET_CHARS <= len(sample.text) <= BUILTIN_CHARS for sample in builtin)
    assert all(f"/{sample.labels[0]}/" in sample.where for sample in builtin)
    assert len({sample.text for sample in builtin}) == len(builtin)
    small = builtin_samples(12)
    assert small == [s for package in BUILTIN_PACKAGES
                     for s in [s for s in builtin if s.labels[0] == package][:12]]


def test_the_built_in_set_as_data(builtin, tmp_path, monkeypatch):
    """source=null: the built-in set (at a cap of 15 here) in 8 classes named by package, split by hash;
    the majority-class accuracy (the training split's most frequent class, on val) is the baseline."""
    monkeypatch.setattr(corpus_module, "BUILTIN_PER_CLASS", 15)
    module = data(None, tmp_path, val_fraction=0.1, test_fraction=0.1, max_length=64)
    info = module.inspect()
    assert info.class_names == sorted(BUILTIN_PACKAGES) and sum(info.sizes.values()) == 8 * 15
    samples = [s for package in BUILTIN_PACKAGES for s in [s for s in builtin if s.labels[0] == package][:15]]
    splits = expected_splits([(s.text, s.labels[0]) for s in samples], 0.1, 0.1)
    assert info.sizes == {split: len(splits[split]) for split in SPLITS}
    counts = Counter(label for _, label in splits["train"])
    top = max(info.class_names, key=lambda name: (counts[name], -info.class_names.index(name)))
    share = sum(label == top for _, label in splits["val"]) / len(splits["val"])
    assert info.baselines == {"val/acc": pytest.approx(share)} and f"'{top}'" in info.notes[3]
    assert "standard library" in info.notes[0]


# -- one-line errors --------------------------------------------------------------------------------------
def test_each_bad_input_is_one_line_naming_its_key_or_file(tmp_path):
    """The label column missing (CSV header, JSONL line), an empty text, an unknown val label, fewer
    than 2 classes, no such source, an unsupported suffix, a tokenizer without [PAD] or no such file,
    a label separator for a source that is not CSV: one line naming the key or the file and line."""
    rows = labelled_rows(12)
    csv_path = tmp_path / "no_label.csv"
    csv_path.write_text("text,category\n" + "".join(f"{t},{y}\n" for t, y in rows))
    missing = _error(lambda: data(csv_path, tmp_path).inspect())
    assert missing.where == "data.label_column" and "category" in str(missing.allowed)

    lines = [{"text": t, "label": y} for t, y in rows]
    lines[4] = {"text": rows[4][0], "class": "apple"}
    missing = _error(lambda: data(write_jsonl(tmp_path / "row.jsonl", lines), tmp_path).inspect())
    assert missing.where == f"{tmp_path / 'row.jsonl'}:5" and "'label'" in missing.problem

    lines[4] = {"text": "   ", "label": "apple"}
    empty = _error(lambda: data(write_jsonl(tmp_path / "empty.jsonl", lines), tmp_path).inspect())
    assert empty.where == f"{tmp_path / 'empty.jsonl'}:5" and empty.problem == "empty text"
    folders = write_folders(tmp_path / "folders", per_class=4)
    (folders / "river" / "blank.txt").write_text("\n")
    assert _error(lambda: data(folders, tmp_path).inspect()).where == str(folders / "river" / "blank.txt")

    splits = tmp_path / "splits"
    write_folders(splits / "train", per_class=4, classes=("apple", "river"))
    write_folders(splits / "val", per_class=2, classes=("apple", "train"))
    unknown = _error(lambda: data(splits, tmp_path).inspect())
    assert unknown.where == str(splits / "val" / "train" / "000.txt") and "unknown label 'train'" in unknown.problem

    rare = next(f"a rare sample {i}" for i in range(100) if split_of(f"a rare sample {i}", 0.2, 0.2) == "val")
    lines = [{"text": t, "label": y} for t, y in labelled_rows(60)] + [{"text": rare, "label": "rare"}]
    drawn = _error(lambda: data(write_jsonl(tmp_path / "rare.jsonl", lines), tmp_path).inspect())
    assert drawn.where == f"{tmp_path / 'rare.jsonl'}:61" and "unknown label 'rare'" in drawn.problem
    assert "drawn by a hash" in drawn.problem

    one = write_folders(tmp_path / "one", per_class=30, classes=("apple",))
    fewer = _error(lambda: data(one, tmp_path).inspect())
    assert fewer.where == "data.source" and "1 class" in fewer.problem and "at least 2" in str(fewer.allowed)

    assert _error(lambda: data(tmp_path / "nowhere.csv", tmp_path).inspect()).where == "data.source"
    (tmp_path / "set.txt").write_text("a text\n")
    suffix = _error(lambda: data(tmp_path / "set.txt", tmp_path).inspect())
    assert suffix.where == "data.source" and ".txt" in suffix.problem

    no_pad = _tokenizer_file(tmp_path / "no_pad.json", ["[UNK]", "[CLS]", "[SEP]"])
    good = write_folders(tmp_path / "good", per_class=20)
    lacking = _error(lambda: data(good, tmp_path, tokenizer=str(no_pad)).inspect())
    assert lacking.where == "data.tokenizer" and "[PAD]" in lacking.problem
    assert _error(lambda: data(folders, tmp_path, tokenizer=str(tmp_path / "no.json"))).where == "data.tokenizer"
    (tmp_path / "broken.json").write_text("{not json")
    assert _error(lambda: data(good, tmp_path, tokenizer=str(tmp_path / "broken.json")).inspect()).where == \
        "data.tokenizer"
    assert _error(lambda: data(folders, tmp_path, label_separator="|")).where == "data.label_separator"
