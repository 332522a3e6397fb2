"""How busy the GPU was while the run trained (GPU and memory-bandwidth utilisation, power), sampled
through NVML on a thread of its own from fit's start to its end: what is logged and summarised, and
how to read it, is in docs/diagnosis.md ("GPU utilisation, memory bandwidth and power").

summary.json's ``device_utilisation`` is over the throughput meter's timed windows only: the means
over the whole fit take in the start-up (building the loaders, cuDNN autotuning, compiling, the
warm-up steps), which kept the first H200 check's short runs at 15-18% "GPU util" whatever they did.
Each sample is stamped with `time.perf_counter()`, the meter's clock. Sampling reads NVML's counters
only: it never synchronizes the device nor touches the training thread."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Annotated, Any, Callable, Iterable, NamedTuple, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import at_log_step
from trainer.callbacks.throughput import ThroughputMeter
from trainer.infra.schema import POSITIVE, Doc

#: What summary.json says of a run whose callbacks do not include the sampler.
NOT_AMONG_CALLBACKS = "not sampled: callbacks=device_stats samples it on CUDA"


def not_sampled(reason: str) -> dict[str, Any]:
    return {"sampled": False, "why": f"not sampled: {reason}"}


def device_utilisation(callbacks: Iterable[Any]) -> dict[str, Any]:
    """summary.json's ``device_utilisation``: the sampler's summary if the run has one, else why not;
    over the timed windows of the run's throughput meter (among the same callbacks) where it has any."""
    callbacks = list(callbacks)
    windows = next((c.window_spans for c in callbacks if isinstance(c, ThroughputMeter)), [])
    sampler = next((c for c in callbacks if isinstance(c, UtilisationSampler)), None)
    return sampler.summary(windows) if sampler is not None else {"sampled": False, "why": NOT_AMONG_CALLBACKS}


class Sample(NamedTuple):
    #: When NVML answered, in `time.perf_counter()` seconds (the throughput meter's clock). NVML's
    #: reading covers its own sample period before that (1/6 s to 1 s, by the device).
    at: float
    gpu: float
    memory: float
    watts: float


def _means(samples: Sequence[Sample]) -> dict[str, float]:
    return {"gpu_util_mean": sum(s.gpu for s in samples) / len(samples),
            "mem_bw_util_mean": sum(s.memory for s in samples) / len(samples),
            "power_w_mean": sum(s.watts for s in samples) / len(samples)}


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values, interpolated linearly between ranks."""
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def nvml_bus_id(properties: Any) -> str:
    """The PCI address NVML knows a device by, from torch's device properties (torch's index counts
    only the devices CUDA_VISIBLE_DEVICES shows, NVML's counts them all: the address is the same in both)."""
    return f"{properties.pci_domain_id:08x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"


class UtilisationSampler(Callback):
    """Samples the run's CUDA device through NVML on a daemon thread between fit's start and end.

    `nvml` is the pynvml module (a stand-in in the tests); None imports it when fit starts."""

    def __init__(self, interval_s: Annotated[float, POSITIVE, Doc("seconds between two NVML samples (NVML's own "
                                                                  "counters average over 1/6 s to 1 s)")] = 0.5,
                 nvml: Any = None, clock: Callable[[], float] = time.perf_counter) -> None:
        """`clock`: what stamps the samples; the throughput meter's windows are read on
        `time.perf_counter()`, so a stand-in is only for tests."""
        self.interval_s = interval_s
        self._nvml = nvml
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._handle: Any = None
        self._started_nvml = False
        #: (when, gpu %, memory-bandwidth %, watts) per sample, in the order taken.
        self.samples: list[Sample] = []
        self._logged_upto = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self.device_name: Optional[str] = None
        self.why_not: Optional[str] = "fit has not started"
        self._began = self._ended = 0.0

    # -- Lightning hooks ---------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start(trainer.strategy.root_device)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stop()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.stop()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.stop()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._thread is None or not trainer.loggers or not at_log_step(trainer):
            return
        metrics = self.means_since_last_log()
        if metrics:
            for logger in trainer.loggers:  # as DeviceStatsMonitor does: no device tensor, no sync
                logger.log_metrics(metrics, step=trainer.global_step)

    # -- the sampling ------------------------------------------------------------------------------
    def start(self, device: torch.device) -> None:
        """Begin sampling `device` (nothing but the reason why not where it is not a CUDA device
        NVML can read)."""
        self.stop()
        self.samples, self._logged_upto, self.errors, self.last_error = [], 0, 0, None
        self._handle = self._open(torch.device(device))
        if self._handle is None:
            return
        self.why_not = None
        self._stop.clear()
        self._began = self._ended = self._clock()
        self._thread = threading.Thread(target=self._loop, name="nvml-utilisation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (a sample in flight finishes); NVML shut down."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5 * self.interval_s + 1)
            self._ended = self._clock()
        if self._started_nvml:
            self._started_nvml = False
            with contextlib.suppress(Exception):  # NVML going away at the end must not fail a run
                self._nvml.nvmlShutdown()

    def _open(self, device: torch.device) -> Any:
        """NVML's handle of `device`, or None with `why_not` set."""
        if device.type != "cuda":
            self.why_not = f"the run is on {device.type}, not CUDA"
            return None
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                self.why_not = "pynvml is not installed (pip install nvidia-ml-py, or the package's gpu extra)"
                return None
            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as ex:  # noqa: BLE001 - NVMLError_* or a missing library: said, not raised
            self.why_not = f"NVML did not start ({type(ex).__name__}: {ex})"
            return None
        self._started_nvml = True
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        self.device_name = properties.name
        attempts: list[tuple[str, Callable[[], Any]]] = [
            ("PCI address", lambda: nvml.nvmlDeviceGetHandleByPciBusId(nvml_bus_id(properties))),
            ("UUID", lambda: nvml.nvmlDeviceGetHandleByUUID(f"GPU-{properties.uuid}"))]
        failures = []
        for how, find in attempts:
            try:
                return find()
            except Exception as ex:  # noqa: BLE001 - the next way, then the reason
                failures.append(f"by {how}: {ex}")
        self.why_not = f"NVML does not know cuda:{index} ({'; '.join(failures)})"
        self.stop()
        return None

    def _loop(self) -> None:
        self.sample()  # one at once, so that a short fit has one
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One sample; an NVML error is counted and the next sample tried (a GPU briefly busy with a
        reset or a driver query may refuse one)."""
        nvml = self._nvml
        try:
            rates = nvml.nvmlDeviceGetUtilizationRates(self._handle)
            watts = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000  # milliwatts
        except Exception as ex:  # noqa: BLE001 - see the docstring
            with self._lock:
                self.errors += 1
                self.last_error = f"{type(ex).__name__}: {ex}"
            return
        at = self._clock()
        with self._lock:
            self.samples.append(Sample(at, float(rates.gpu), float(rates.memory), float(watts)))
            self._ended = at

    # -- what it found ----------------------------------------------------------------------------
    def means_since_last_log(self) -> dict[str, float]:
        """The means of the samples taken since the last call, as logged metrics (empty if none)."""
        with self._lock:
            fresh, self._logged_upto = self.samples[self._logged_upto:], len(self.samples)
        if not fresh:
            return {}
        means = _means(fresh)
        return {"device/gpu_util": means["gpu_util_mean"], "device/mem_bw_util": means["mem_bw_util_mean"],
                "device/power_w": means["power_w_mean"]}

    def summary(self, windows: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
        """summary.json's ``device_utilisation``: what was sampled, or why nothing was. `windows`: the
        throughput meter's timed windows, (start, end) in `time.perf_counter()` seconds; the figures
        are over the samples taken inside them (`over` says so, and `whole_fit` gives the fit's means
        beside them), or over the whole fit, with why, where there are none or none fell inside."""
        with self._lock:
            samples, errors, last_error = list(self.samples), self.errors, self.last_error
        if self.why_not is not None:
            return not_sampled(self.why_not)
        if not samples:
            return not_sampled(f"every NVML query failed ({errors}, the last: {last_error})")
        fit_seconds = self._ended - self._began
        timed = sum(end - start for start, end in windows)
        inside = [s for s in samples if any(start <= s.at <= end for start, end in windows)]
        count = f"{len(windows)} timed window{'s' if len(windows) != 1 else ''}"
        if inside:
            chosen, seconds, over = inside, timed, f"the throughput meter's {count} ({timed:.1f} s)"
        else:
            why = (f"no sample fell inside the throughput meter's {count} ({timed:.2f} s, a sample every "
                   f"{self.interval_s:g} s)" if windows else "the throughput meter timed no window")
            chosen, seconds, over = samples, fit_seconds, f"the whole fit ({fit_seconds:.1f} s): {why}"
        gpu = sorted(s.gpu for s in chosen)
        result: dict[str, Any] = {
            "sampled": True, "device": self.device_name, "over": over, "samples": len(chosen),
            "interval_s": self.interval_s, "seconds": round(seconds, 3),
            **_means(chosen), "gpu_util_p50": percentile(gpu, 50), "gpu_util_p95": percentile(gpu, 95),
            "power_w_max": max(s.watts for s in chosen),
            "errors": errors, **({"last_error": last_error} if last_error else {}),
        }
        if inside:
            result["whole_fit"] = {"samples": len(samples), "seconds": round(fit_seconds, 3), **_means(samples)}
        return result
