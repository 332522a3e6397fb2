"""``deploy load`` of a text model's server: the run's validation texts sent by a real HTTP client
(aiohttp, one keep-alive connection per caller) to one ``serve`` process on a free loopback port.

- An encoder: texts grouped into length bins (the server's own, `serve_text.length_bin`: tokens up to
  8, 16, 32, 64, ...) and all lengths mixed; per bin and concurrency the QPS, P50/P90/P99 latency
  (request sent to answer read), the mean batch the server formed, the mean padded length, how often
  the top class is the label.
- A language model: prompts cut from the validation documents; per concurrency the time to first
  token P50/P99 as the client sees it over ``/generate/stream`` (request sent to its first line), the
  time per token P50 (between the first and the last token's lines, per request), tokens/s (all
  tokens over the measurement's wall time) and the server's own time to first token.

Each measurement is bounded by ``--requests`` and ``--budget-s``; at the end the server's processes'
RSS and PSS (`serve.server_processes`). Written to ``RUN_DIR/deploy_load.md`` and ``.json``."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from trainer.deploy.bench import percentile
from trainer.deploy.load import ServerProcess, nothing_answered, run_callers
from trainer.infra.atomic import write_json_atomic, write_text_atomic
from trainer.infra.errors import UserError

#: Tokens each load request asks a language model for, and the longest prompt it sends.
GENERATED_TOKENS, PROMPT_TOKENS = 32, 64
ALL_LENGTHS = "all"


@dataclass(frozen=True)
class TextSample:
    text: str
    label: Optional[int]  # an encoder's first label; None for a prompt
    bin: str


@dataclass(frozen=True)
class TextLoadRow:
    bin: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    #: encoder: mean batch, mean padded length, top-1 = label; language model: the ttft and per-token figures
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def qps(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


# -- what the client sends -------------------------------------------------------------------------------
def _run_data(run_dir: Path) -> Any:
    """The run's data module alone (no network), told a scratch folder as its run folder."""
    from omegaconf import OmegaConf

    from trainer.configuration.spec import validate
    from trainer.data.group import build_data

    spec = validate(OmegaConf.load(run_dir / "config_resolved.yaml"))  # type: ignore[arg-type]
    scratch = tempfile.mkdtemp(prefix="load-text-")
    return build_data(spec.data, Path(scratch), spec.top.seed)[0]


def encoder_samples(run_dir: Path, card: dict[str, Any], folder: Path, count: int = 512) -> list[TextSample]:
    """Up to `count` of the run's validation texts with their (first) label, in length bins."""
    from trainer.data.labelled_corpus import open_source, split_samples
    from trainer.deploy.serve_text import TextTokenizer, length_bin

    data = _run_data(run_dir)
    source = open_source(data.source)
    samples, _ = source.read(data.settings.columns)
    val = split_samples(source, samples, data.settings.val_fraction, data.settings.test_fraction)["val"]
    # in a fixed random order: a source's samples often come class by class, and "all" mixes them
    val = [val[i] for i in np.random.default_rng(0).permutation(len(val))[:count]]
    text = card["text"]
    tokenize = TextTokenizer(folder / text["tokenizer"], int(text["max_length"]), int(text["sep_id"]))
    index = {name: i for i, name in enumerate(card["classes"])}
    return [TextSample(s.text, index.get(s.labels[0]) if s.labels else None,
                       str(length_bin(len(tokenize(s.text)[0]), int(text["max_length"])))) for s in val]


def prompt_samples(run_dir: Path, card: dict[str, Any], folder: Path, count: int = 256) -> list[TextSample]:
    """Up to `count` prompts: the first up to `PROMPT_TOKENS` tokens of validation documents (at most
    half the context), decoded with the export's tokenizer."""
    from tokenizers import Tokenizer

    prepared = _run_data(run_dir).prepared()
    tokens, offsets = prepared.tokens("val"), prepared.offsets("val")
    tokenizer = Tokenizer.from_file(str(folder / card["text"]["tokenizer"]))
    longest = min(PROMPT_TOKENS, int(card["text"]["context"]) // 2)
    prompts = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        ids = [int(t) for t in tokens[start:min(end, start + longest)] if int(t) != card["text"]["end_of_text_id"]]
        text = tokenizer.decode(ids)
        if text.strip():
            prompts.append(TextSample(text, None, ALL_LENGTHS))
        if len(prompts) >= count:
            break
    return prompts


# -- the client ------------------------------------------------------------------------------------------
async def measure_encoder(url: str, samples: Sequence[TextSample], name: str, concurrency: int, requests: int,
                          budget_s: float) -> TextLoadRow:
    import aiohttp

    latencies: list[float] = []
    answers: list[tuple[int, int, bool]] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def call(i: int) -> None:
            nonlocal errors
            sample = samples[i % len(samples)]
            sent = time.perf_counter()
            async with session.post(url, json={"text": sample.text}) as response:
                answer = await response.json(content_type=None)
            if response.status != 200:
                errors += 1
                return
            latencies.append((time.perf_counter() - sent) * 1000)
            answers.append((answer["batch"], answer["length"], answer["top_k"][0]["index"] == sample.label
                            if "top_k" in answer else False))

        await asyncio.gather(*(call(i) for i in range(concurrency)))  # untimed: connections open
        latencies.clear()
        answers.clear()
        wall = await run_callers(concurrency, requests, budget_s, call)
    if not latencies:
        raise nothing_answered(url, errors)
    batches, lengths, hits = (np.asarray(column, dtype=np.float64) for column in zip(*answers))
    return TextLoadRow(name, concurrency, len(latencies), errors, wall, percentile(latencies, 50),
                       percentile(latencies, 90), percentile(latencies, 99),
                       {"mean_batch": float(batches.mean()), "mean_length": float(lengths.mean()),
                        "top1_is_label": float(hits.mean())})


async def measure_generation(url: str, samples: Sequence[TextSample], concurrency: int, requests: int,
                             budget_s: float, max_tokens: int = GENERATED_TOKENS) -> TextLoadRow:
    """Streamed generations: the client's time to first token and per token, tokens/s, latency of the whole."""
    import aiohttp

    whole, first, per_token, server_first = [], [], [], []
    tokens, errors = 0, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def call(i: int) -> None:
            nonlocal tokens, errors
            body = {"prompt": samples[i % len(samples)].text, "max_tokens": max_tokens, "seed": i}
            sent = time.perf_counter()
            arrivals, last = [], {}
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    errors += 1
                    return
                async for line in response.content:
                    arrivals.append(time.perf_counter())
                    last = json.loads(line)
            whole.append((arrivals[-1] - sent) * 1000)
            first.append((arrivals[0] - sent) * 1000)
            if last.get("tokens", 0) > 1 and len(arrivals) > 2:  # token lines: all but the final answer
                per_token.append((arrivals[-2] - arrivals[0]) * 1000 / (len(arrivals) - 2))
            if last.get("ttft_ms") is not None:
                server_first.append(float(last["ttft_ms"]))
            tokens += int(last.get("tokens", 0))

        await asyncio.gather(*(call(i) for i in range(concurrency)))  # untimed: connections open
        for values in (whole, first, per_token, server_first):
            values.clear()
        tokens = 0
        wall = await run_callers(concurrency, requests, budget_s, call)
    if not whole:
        raise nothing_answered(url, errors)
    return TextLoadRow(ALL_LENGTHS, concurrency, len(whole), errors, wall, percentile(whole, 50),
                       percentile(whole, 90), percentile(whole, 99),
                       {"ttft_p50_ms": percentile(first, 50), "ttft_p99_ms": percentile(first, 99),
                        "tpot_p50_ms": percentile(per_token, 50) if per_token else float("nan"),
                        "tokens_per_s": tokens / wall, "server_ttft_p50_ms": percentile(server_first, 50)})


# -- the command -----------------------------------------------------------------------------------------
def server_memory(main_pid: int) -> dict[str, dict[str, float]]:
    """RSS and PSS in MiB of each of the server's processes, by role (and their sums)."""
    from trainer.deploy.serve import process_memory

    memory = {f"{role} ({pid})": {"rss_mib": rss / 2**20, "pss_mib": pss / 2**20}
              for pid, role, rss, pss in process_memory(main_pid)}
    memory["total"] = {key: sum(m[key] for m in memory.values()) for key in ("rss_mib", "pss_mib")}
    return memory


def load_text_run(run_dir: Path, folder: Path, card: dict[str, Any], concurrencies: Sequence[int], requests: int,
                  budget_s: float, max_batch_size: int, batch_timeout_ms: float,
                  extra: Sequence[str] = (), server: Optional[ServerProcess] = None) -> "TextLoadReport":
    """An encoder's or a language model's server under load (see the module's docstring): one started
    for it, or `server`, already started from `folder` with these settings and left running."""
    generating = card.get("task") == "language_model"
    samples = prompt_samples(run_dir, card, folder) if generating else encoder_samples(run_dir, card, folder)
    if not samples:
        raise UserError(str(run_dir), "has no validation text to send", "a run whose validation split holds text")
    if server is None:
        logs = run_dir / "deploy_load_logs"
        logs.mkdir(exist_ok=True)
        with ServerProcess(folder, max_batch_size, batch_timeout_ms, logs / "text.log", extra) as started:
            started.wait_ready()
            rows, memory = _measure(started, samples, generating, concurrencies, requests, budget_s)
    else:
        rows, memory = _measure(server, samples, generating, concurrencies, requests, budget_s)
    report = TextLoadReport(rows, memory, generating, run_dir / "deploy_load.md",
                            {name: sum(1 for s in samples if s.bin == name) for name in {s.bin for s in samples}})
    write_text_report(report, folder, max_batch_size, batch_timeout_ms)
    return report


def _measure(server: ServerProcess, samples: Sequence[Any], generating: bool, concurrencies: Sequence[int],
             requests: int, budget_s: float) -> tuple[list["TextLoadRow"], dict[str, Any]]:
    """The rows (per concurrency; an encoder's also per length bin and all lengths) and the server's memory."""
    rows: list[TextLoadRow] = []
    for concurrency in concurrencies:
        if generating:
            rows.append(asyncio.run(measure_generation(server.url + "/generate/stream", samples, concurrency,
                                                       requests, budget_s)))
            continue
        for name in [*sorted({s.bin for s in samples}, key=int), ALL_LENGTHS]:
            chosen = [s for s in samples if name in (s.bin, ALL_LENGTHS)]
            rows.append(asyncio.run(measure_encoder(server.url + "/predict", chosen, name, concurrency,
                                                    requests, budget_s)))
    return rows, server_memory(server.process.pid)


@dataclass
class TextLoadReport:
    rows: list[TextLoadRow]
    memory: dict[str, dict[str, float]]
    generating: bool
    markdown: Path
    samples: dict[str, int]

    def lines(self) -> list[str]:
        total = self.memory.get("total", {})
        return [*self.table(), f"server memory: RSS {total.get('rss_mib', 0):,.0f} MiB, PSS "
                               f"{total.get('pss_mib', 0):,.0f} MiB over {len(self.memory) - 1} processes"]

    def table(self) -> list[str]:
        if self.generating:
            lines = ["| concurrency | requests | tokens/s | TTFT P50 ms | TTFT P99 ms | per token P50 ms | "
                     "server TTFT P50 ms | whole P50 ms | whole P99 ms | errors |", "|---:" * 10 + "|"]
            return lines + [f"| {r.concurrency} | {r.requests} | {r.figures['tokens_per_s']:,.1f} | "
                            f"{r.figures['ttft_p50_ms']:.2f} | {r.figures['ttft_p99_ms']:.2f} | "
                            f"{r.figures['tpot_p50_ms']:.2f} | {r.figures['server_ttft_p50_ms']:.2f} | "
                            f"{r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.errors} |" for r in self.rows]
        lines = ["| tokens (bin) | concurrency | requests | QPS | P50 ms | P90 ms | P99 ms | mean batch | "
                 "mean padded length | top-1 = label | errors |", "|---|" + "---:|" * 10]
        return lines + [f"| {'up to ' + r.bin if r.bin != ALL_LENGTHS else 'all'} | {r.concurrency} | {r.requests} | "
                        f"{r.qps:,.0f} | {r.p50_ms:.2f} | {r.p90_ms:.2f} | {r.p99_ms:.2f} | "
                        f"{r.figures['mean_batch']:.1f} | {r.figures['mean_length']:.0f} | "
                        f"{r.figures['top1_is_label']:.1%} | {r.errors} |" for r in self.rows]


def write_text_report(report: TextLoadReport, folder: Path, max_batch_size: int, batch_timeout_ms: float) -> None:
    import torch

    from trainer.infra.fingerprint import cpu_name

    where = f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    what = ("prompts from the validation documents, streamed" if report.generating else
            "validation texts by length bin (the server's: a batch holds one bin)")
    memory = ["| process | RSS MiB | PSS MiB |", "|---|---:|---:|"] + [
        f"| {name} | {m['rss_mib']:,.0f} | {m['pss_mib']:,.0f} |" for name, m in report.memory.items()]
    lines = [f"# Serving a text model under load: {folder}", "",
             f"{what}; {where}; max batch {max_batch_size}, batch timeout {batch_timeout_ms:g} ms.", "",
             *report.table(), "", "Server memory after the load:", "", *memory]
    write_text_atomic(report.markdown, "\n".join(lines) + "\n")
    write_json_atomic(report.markdown.with_suffix(".json"), {
        "export": str(folder), "machine": where, "generating": report.generating, "samples_per_bin": report.samples,
        "max_batch_size": max_batch_size, "batch_timeout_ms": batch_timeout_ms, "memory_mib": report.memory,
        "rows": [asdict(r) | {"qps": r.qps} for r in report.rows]})
