"""How busy the GPU was while the run trained, sampled through NVML: GPU utilisation (the share of
time a kernel ran), memory-bandwidth utilisation (the share of time device memory was read or
written) and power, every half second on a thread of its own from fit's start to its end.

Logged as ``device/gpu_util``, ``device/mem_bw_util`` (percent) and ``device/power_w`` (the means
since the last log) every ``trainer.log_every_n_steps`` steps, and summarised for summary.json's
``device_utilisation`` (`device_utilisation`). Sampling reads NVML's counters only: it never
synchronizes the device nor touches the training thread. Where it cannot sample (no CUDA, no
pynvml, NVML refusing to start) the summary says why and the run goes on."""

from __future__ import annotations

import math
import threading
import time
from typing import Annotated, Any, Callable, Iterable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import at_log_step
from trainer.infra.schema import POSITIVE, Doc

#: What summary.json says of a run whose callbacks do not include the sampler.
NOT_AMONG_CALLBACKS = "not sampled: callbacks=device_stats samples it on CUDA"


def not_sampled(reason: str) -> dict[str, Any]:
    return {"sampled": False, "why": f"not sampled: {reason}"}


def device_utilisation(callbacks: Iterable[Any]) -> dict[str, Any]:
    """summary.json's ``device_utilisation``: the sampler's summary if the run has one, else why not."""
    for callback in callbacks:
        if isinstance(callback, UtilisationSampler):
            return callback.summary()
    return {"sampled": False, "why": NOT_AMONG_CALLBACKS}


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
                 nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._nvml = nvml
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._handle: Any = None
        self._started_nvml = False
        #: (gpu %, memory-bandwidth %, watts) per sample, in the order taken.
        self.samples: list[tuple[float, float, float]] = []
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
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - NVML going away at the end must not fail a run
                pass

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
        with self._lock:
            self.samples.append((float(rates.gpu), float(rates.memory), float(watts)))
            self._ended = self._clock()

    # -- what it found ----------------------------------------------------------------------------
    def means_since_last_log(self) -> dict[str, float]:
        """The means of the samples taken since the last call, as logged metrics (empty if none)."""
        with self._lock:
            fresh, self._logged_upto = self.samples[self._logged_upto:], len(self.samples)
        if not fresh:
            return {}
        return {name: sum(s[i] for s in fresh) / len(fresh)
                for i, name in enumerate(("device/gpu_util", "device/mem_bw_util", "device/power_w"))}

    def summary(self) -> dict[str, Any]:
        """summary.json's ``device_utilisation``: what was sampled, or why nothing was."""
        with self._lock:
            samples, errors, last_error = list(self.samples), self.errors, self.last_error
        if self.why_not is not None:
            return not_sampled(self.why_not)
        if not samples:
            return not_sampled(f"every NVML query failed ({errors}, the last: {last_error})")
        gpu = sorted(s[0] for s in samples)
        watts = [s[2] for s in samples]
        return {
            "sampled": True, "device": self.device_name, "samples": len(samples), "interval_s": self.interval_s,
            "seconds": round(self._ended - self._began, 3),
            "gpu_util_mean": sum(gpu) / len(gpu), "gpu_util_p50": percentile(gpu, 50),
            "gpu_util_p95": percentile(gpu, 95),
            "mem_bw_util_mean": sum(s[1] for s in samples) / len(samples),
            "power_w_mean": sum(watts) / len(watts), "power_w_max": max(watts),
            "errors": errors, **({"last_error": last_error} if last_error else {}),
        }
