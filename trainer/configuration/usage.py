"""The opening of `--help`: what the command is and how it is used, in the words of the command that
was typed (`python train.py`, `python -m trainer` or `gpu-practice-train`, trainer/infra/command.py),
with the entry point's subcommands beside the runs. Filled into conf/hydra/help/trainer.yaml by the
``${usage:}`` resolver; imports nothing heavy."""

from __future__ import annotations

from trainer.infra.command import invoked_as

#: (arguments, what they do): the runs first, then the subcommands.
RUN_EXAMPLES = (
    ("", "small CNN on the bundled digits (nothing downloaded)"),
    ("model=resnet18 data=synthetic", "pick choices of groups"),
    ("optimizer.lr=0.003 data.batch_size=128", "override any key"),
    ("+recipe=digits_quickstart", "a recipe: shipped, or your team folder's recipes/"),
    ("-m optimizer.lr=0.001,0.003", "a Hydra multirun sweep (comparison.md at its end)"),
    ("-m +ladder=resnet18_cpu", "an optimization ladder: one job per stage, compared"),
    ("+recipe=resnet50_optimized diagnose=true data=synthetic", "where the time of a step goes"),
    ("hparams_search=digits_optuna", "an Optuna study in SQLite (the 'sweeps' extra)"),
    ("resume=auto", "carry on from the newest checkpoint of this run (run.name)"),
    ("trainer=ddp", "one process per GPU (Lightning's DDP); torchrun and SLURM too"),
)
SUBCOMMANDS = (
    ("scaffold vision-team", "a team's own repository: recipes, configs, code, tests, pyproject"),
    ("deploy export RUN_DIR", "the trained model as ONNX, torch.export and safetensors"),
    ("deploy serve RUN_DIR", "behind a batching HTTP server; also deploy bench|load (--help)"),
    ("deploy weights CKPT OUT.safetensors", "a checkpoint's model weights alone, as safetensors"),
)
COMMENT_COLUMN = 53


def usage(command: str | None = None) -> str:
    """The help's header for `command` (default: the one typed)."""
    command = command or invoked_as()
    lines = [f"{command}: configuration-driven PyTorch training with the GPU best practices on by default.",
             "", "Compose a run from config groups and override any key:"]
    lines += [_example(command, arguments, doc) for arguments, doc in RUN_EXAMPLES]
    lines += ["", "Beside the runs:"]
    lines += [_example(command, arguments, doc) for arguments, doc in SUBCOMMANDS]
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the help template with string.Template


def _example(command: str, arguments: str, doc: str) -> str:
    return with_comment(f"  {command} {arguments}".rstrip(), doc, COMMENT_COLUMN)


def with_comment(text: str, doc: str, column: int) -> str:
    """`text` then ``# doc``, padded to `column` where it is shorter (`--help`, conf/'s key comments)."""
    if not doc:
        return text
    return f"{text:<{column}} # {doc}" if len(text) < column else f"{text}  # {doc}"
