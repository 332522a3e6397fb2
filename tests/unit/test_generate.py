"""`python -m trainer.generate RUN_DIR --prompt ...`: the run's network and tokenizer continue a prompt;
greedy output is deterministic and starts with the prompt; user mistakes (no folder, not a language
model, an empty prompt, bad sampling numbers) are one line on stderr with exit code 2.

The run folder is fabricated in tmp_path: a config file, a real checkpoint of a tiny GPT's weights
under the ``net.`` prefix (as the LightningModule saves them) and a ByteLevel BPE tokenizer trained
on a few lines. `load_network` itself is replaced by `fake_load_network`, which reads that checkpoint
the way it does: the real one rebuilds the data module from the saved config, which for text means
a corpus and its tokenization, too slow for a unit test (a real run folder was checked by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.helpers import python_forked
from trainer.deploy.export import NET_PREFIX
from trainer.generate import main
from trainer.infra.checkpoint_files import load_checkpoint
from trainer.infra.errors import EXIT_USER_ERROR
from trainer.models.gpt import GPT
from trainer.models.small_cnn import SmallCNN

LINES = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
         "the early bird catches the worm", "all that glitters is not gold"] * 5
CONTEXT = 12


def train_tokenizer(path: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(LINES, trainer)
    tokenizer.save(str(path))
    return tokenizer


def tiny_gpt(vocab_size: int) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size, CONTEXT, style="llama", layers=2, heads=2, width=16)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run folder as a language-model run leaves it: config, checkpoints/last.ckpt, tokenizer.json."""
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config_resolved.yaml").write_text("model:\n  _target_: trainer.models.gpt.GPT\n")
    tokenizer = train_tokenizer(folder / "tokenizer.json")
    state = {NET_PREFIX + k: v for k, v in tiny_gpt(tokenizer.get_vocab_size()).state_dict().items()}
    torch.save({"state_dict": state}, folder / "checkpoints" / "last.ckpt")
    return folder


def fake_load_network(run_dir: Path, checkpoint: Path, scratch: Path) -> tuple:
    """load_network's network part: a GPT of the run's shape with the checkpoint's weights."""
    vocab_size = Tokenizer.from_file(str(run_dir / "tokenizer.json")).get_vocab_size()
    net = tiny_gpt(vocab_size)
    for p in net.parameters():
        p.data.zero_()  # the weights must come from the checkpoint
    state = load_checkpoint(checkpoint)["state_dict"]
    net.load_state_dict({k[len(NET_PREFIX):]: v for k, v in state.items()})
    return net, None, None, None


@pytest.fixture
def fake_loader(monkeypatch):
    monkeypatch.setattr("trainer.deploy.export.load_network", fake_load_network)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main([*argv, "--device", "cpu"])
    except SystemExit as ex:
        code = int(ex.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_continuation_starts_with_the_prompt_and_is_deterministic(run_dir, fake_loader, capsys):
    """--greedy prints the prompt and its continuation, the same text twice."""
    first = run_main(capsys, str(run_dir), "--prompt", "the quick brown", "--greedy", "--max-new-tokens", "20")
    second = run_main(capsys, str(run_dir), "--prompt", "the quick brown", "--greedy", "--max-new-tokens", "20")
    assert first[0] == 0 and first == second
    text = first[1].rstrip("\n")
    assert text.startswith("the quick brown") and len(text) > len("the quick brown")


def test_sampling_is_reproducible_with_its_seed(run_dir, fake_loader, capsys):
    """Sampled text depends on --seed only: the same seed gives the same text; no new tokens give the prompt."""
    args = (str(run_dir), "--prompt", "a stitch", "--temperature", "1.5", "--top-k", "20", "--max-new-tokens", "30")
    assert run_main(capsys, *args, "--seed", "1") == run_main(capsys, *args, "--seed", "1")
    assert run_main(capsys, str(run_dir), "--prompt", "a stitch", "--max-new-tokens", "0")[1] == "a stitch\n"


def test_the_prompt_may_be_longer_than_the_context(run_dir, fake_loader, capsys):
    """A prompt of more tokens than max_positions still continues: the context is its last max_positions tokens."""
    prompt = " ".join(LINES[:3])
    assert len(Tokenizer.from_file(str(run_dir / "tokenizer.json")).encode(prompt).ids) > CONTEXT
    code, out, _ = run_main(capsys, str(run_dir), "--prompt", prompt, "--greedy", "--max-new-tokens", "5")
    assert code == 0 and out.startswith(prompt)


def assert_one_line_error(result: tuple[int, str, str], fragment: str) -> None:
    code, out, err = result
    assert code == EXIT_USER_ERROR and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert fragment in err


def test_no_such_folder(tmp_path, capsys):
    """A folder that does not exist: one line naming it."""
    assert_one_line_error(run_main(capsys, str(tmp_path / "nowhere"), "--prompt", "hi"), "does not exist")


def test_a_run_without_a_tokenizer_is_not_a_language_model(run_dir, fake_loader, capsys):
    """An image run (no tokenizer.json) is refused before its network is loaded."""
    (run_dir / "tokenizer.json").unlink()
    assert_one_line_error(run_main(capsys, str(run_dir), "--prompt", "hi"), "is not a language-model run (no tokenizer.json)")


def test_a_run_whose_network_is_not_a_gpt(run_dir, monkeypatch, capsys):
    """A run whose network is another class (a classifier) is refused by name."""
    monkeypatch.setattr("trainer.deploy.export.load_network", lambda *args: (SmallCNN(num_classes=3), None, None, None))
    assert_one_line_error(run_main(capsys, str(run_dir), "--prompt", "hi"), "its network is SmallCNN")


@pytest.mark.parametrize("argv, fragment", [
    (("--prompt", "   "), "--prompt: is empty"),
    (("--prompt", "hi", "--temperature", "0"), "--temperature: must be greater than 0"),
    (("--prompt", "hi", "--top-k", "0"), "--top-k: must be at least 1"),
    (("--prompt", "hi", "--max-new-tokens", "-3"), "--max-new-tokens: must be at least 0"),
])
def test_bad_options_are_one_line(run_dir, fake_loader, capsys, argv, fragment):
    """An empty prompt and impossible sampling numbers stop before anything is loaded."""
    assert_one_line_error(run_main(capsys, str(run_dir), *argv), fragment)


def test_the_module_runs_from_the_command_line(tmp_path):
    """`python -m trainer.generate` is the entry point: a missing folder is exit code 2, one line, no traceback."""
    done = python_forked(["-m", "trainer.generate", str(tmp_path / "nowhere"), "--prompt", "hi"], timeout=120)
    assert done.returncode == EXIT_USER_ERROR and done.stdout == ""
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
