"""What a fit says about Dynamo's compiles (trainer.groups.compile): `compile_counts` counts frames and
the times a function reached Dynamo's recompile limit (past it, new shapes run eager with only a line
in Dynamo's log), and `compiled_line` is the line a fit ends with: the recompiles, and the limit with
the way out when dynamic=false reached it."""

from __future__ import annotations

import pytest
import torch

from trainer.groups.compile import compile_counts, compiled_line


def test_the_line_counts_recompiles_and_names_the_limit_and_the_way_out():
    quiet = {"frames_compiled": 2, "graphs": 2, "graph_breaks": 0, "recompile_limit_hits": 0, "dynamic": True}
    assert compiled_line(quiet) == ("compile: 2 frame(s) compiled in fit (1 recompile(s)), 2 graph(s), 0 graph "
                                    "break(s), dynamic=True")
    limit = torch._dynamo.config.recompile_limit
    hit = {**quiet, "frames_compiled": limit, "graphs": limit, "recompile_limit_hits": 1, "dynamic": False}
    line = compiled_line(hit)
    assert line.startswith(f"compile: {limit} frame(s) compiled in fit ({limit - 1} recompile(s))")
    assert line.endswith(f"; Dynamo's recompile limit ({limit}) was reached: batches of shapes past it ran eager "
                         "(compile.dynamic=true compiles one graph for every length)")
    assert "compile.dynamic=true" not in compiled_line({**hit, "dynamic": None})
    assert compiled_line({key: value for key, value in quiet.items() if key != "recompile_limit_hits"}) == \
        compiled_line(quiet)  # a summary written before the key


@pytest.mark.slow
def test_the_counts_see_every_recompile_and_the_limit():
    """Dynamo's eager backend (no code generation): a function called at limit + 3 lengths compiles
    `limit` frames with dynamic=false and reaches the limit; with dynamic=true one frame serves all.
    The limit is set here (4), not read: importing timm.optim raises it process-wide to 1,000,000
    (timm/optim/kron.py), so in a worker that imported it first the loop below ran 256 frames and
    18 minutes before Dynamo's accumulated limit stopped it. In this process, Dynamo reset before and
    after: a forked child of an xdist worker hung here once in the full suite."""
    limit = 4
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            for dynamic, frames, hits in ((False, limit, True), (True, 1, False)):
                torch._dynamo.reset()
                before = compile_counts()
                double = torch.compile(lambda x: x * 2, backend="eager", dynamic=dynamic)
                for length in range(2, limit + 5):
                    assert torch.equal(double(torch.ones(length)), torch.full((length,), 2.0))
                after = compile_counts()
                counted = {key: after[key] - before[key] for key in after}
                assert counted["frames_compiled"] == frames, (dynamic, counted)
                assert (counted["recompile_limit_hits"] > 0) == hits, (dynamic, counted)
                assert counted["graph_breaks"] == 0
    finally:
        torch._dynamo.reset()
