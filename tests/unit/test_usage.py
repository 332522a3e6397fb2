"""The help's header speaks the command that was typed (trainer/infra/command.py,
trainer/configuration/usage.py): a wheel user never sees a train.py they do not have."""

import pytest

from trainer.configuration.usage import usage
from trainer.infra.command import CHECKOUT, MODULE, SCRIPT, invoked_as, subcommand


@pytest.mark.parametrize("argv0, expected", [
    ("train.py", CHECKOUT),
    ("/work/checkout/train.py", CHECKOUT),
    ("/venv/bin/gpu-practice-train", SCRIPT),
    ("/venv/Scripts/gpu-practice-train.exe", SCRIPT),  # Windows script wrappers
    ("/venv/lib/python3.11/site-packages/trainer/__main__.py", MODULE),  # what `python -m trainer` sets
    ("-c", MODULE),  # python -c / an embedding program: the installed form
])
def test_the_command_is_read_from_argv0(argv0, expected):
    assert invoked_as([argv0, "--help"]) == expected


def test_no_argv_reads_as_the_module_form():
    assert invoked_as([]) == MODULE


def test_subcommands_start_as_the_command_did():
    assert subcommand("deploy", ["/venv/bin/gpu-practice-train"]) == "gpu-practice-train deploy"


@pytest.mark.parametrize("command", [CHECKOUT, MODULE, SCRIPT])
def test_every_example_of_the_header_starts_with_the_command_typed(command):
    lines = usage(command).splitlines()
    assert lines[0].startswith(f"{command}: ")
    examples = [line for line in lines if line.startswith("  ")]
    assert len(examples) >= 12
    assert all(line.startswith(f"  {command}") for line in examples)
    others = {CHECKOUT, MODULE, SCRIPT} - {command}
    assert not any(other in line for line in lines for other in others)


def test_the_header_lists_scaffold_and_deploy():
    text = usage(SCRIPT)
    assert "gpu-practice-train scaffold " in text
    assert "gpu-practice-train deploy export " in text and "gpu-practice-train deploy serve " in text


def test_the_header_names_every_deploy_subcommand(capsys):
    """Every subcommand `python -m trainer.deploy` takes is in the header (weights once was not)."""
    import re

    from trainer.deploy.__main__ import main as deploy_main

    with pytest.raises(SystemExit):
        deploy_main(["--help"])
    subcommands = re.search(r"\{([a-z,]+)\}", capsys.readouterr().out).group(1).split(",")
    assert len(subcommands) >= 5
    text = usage(SCRIPT)
    listed = {name for names in re.findall(r"deploy ([\w|]+)", text) for name in names.split("|")}
    assert set(subcommands) <= listed, (subcommands, listed)
