"""Lightning's model summary (the table of modules and parameter counts printed as fit starts),
without its FLOP count.

Why: Lightning counts FLOPs only by running `example_input_array` through the module, which the
framework's task does not set, so it printed a FLOPs column of zeros and "Total FLOPs: 0" right below
the plan's own count (`model.flops_per_sample`). Otherwise Lightning's: the same data, the Rich table
where Rich is installed (as Lightning chooses), its plain table otherwise."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import (_format_summary_table, get_formatted_model_size,
                                                                     get_human_readable_count)

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's table goes

#: Lightning's name for the column dropped.
FLOPS_COLUMN = "FLOPs"


def _without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, values) for name, values in summary_data if name != FLOPS_COLUMN]


def _totals(total_parameters: int, trainable_parameters: int, model_size: float,
            total_training_modes: dict[str, int]) -> list[tuple[str, str]]:
    """Lightning's lines under the table, less "Total FLOPs"."""
    return [("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"]))]


class PlainModelSummary(ModelSummary):
    """Lightning's plain-text model summary without the FLOP count (see the module docstring)."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *_without_flops(summary_data))
        log.info("\n" + table.rsplit("\n", 1)[0])  # Lightning's table less its last line, "Total Flops"


class RichModelSummaryWithoutFlops(RichModelSummary):
    """Lightning's Rich model summary without the FLOP count (see the module docstring)."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from rich import get_console
        from rich.table import Table

        columns = _without_flops(summary_data)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        table.add_column(" ", style="dim")
        for name, _ in columns[1:]:  # the first is the row number, Lightning's unnamed column
            right = name not in ("Name", "Type", "Mode")
            table.add_column(name, justify="right" if right else "left", no_wrap=name == "Name",
                             style="white" if name in ("In sizes", "Out sizes") else None)
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for name, value in _totals(total_parameters, trainable_parameters, model_size, total_training_modes):
            grid.add_row(f"[bold]{name}[/]: {value:<10}")
        console.print(grid)


def model_summary(max_depth: int = 1) -> ModelSummary:
    """The summary Lightning would add by default (Rich where Rich is installed), less its FLOPs."""
    return RichModelSummaryWithoutFlops(max_depth) if _RICH_AVAILABLE else PlainModelSummary(max_depth)
