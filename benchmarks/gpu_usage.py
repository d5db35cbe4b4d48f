"""What the GPU proof records about the GPUs during each run: raw `nvidia-smi` text dumps, nvidia-smi's own CSV log
every second (`baselines.utilisation.NvidiaSmiLog`), and an NVML series of utilisation and memory every second.

The series is taken by NVML index over every GPU the driver sees, from the process that orchestrates the runs, so
it covers runs whose work happens in other processes (batch-search trials, DDP ranks, swarm peers) alike, and that
process never creates a CUDA context of its own (which would take GPU memory from the runs it measures).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from baselines.utilisation import NvidiaSmiLog
from hivetrain.sampling import PeriodicSampler

# The two raw views: the overview (GPUs, memory, processes) and the memory and utilisation details.
NVIDIA_SMI_VIEWS = {
    "nvidia-smi": ["nvidia-smi"],
    "nvidia-smi-q": ["nvidia-smi", "-q", "-d", "MEMORY,UTILIZATION"],
}


def write_nvidia_smi_dumps(folder: Path, label: str) -> list[str]:
    """Both raw views as text files `<label>.nvidia-smi.txt` and `<label>.nvidia-smi-q.txt` in `folder`, each headed
    by its command and the time it was taken; returns their file names (none when nvidia-smi is missing)."""
    if shutil.which("nvidia-smi") is None:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for view, command in NVIDIA_SMI_VIEWS.items():
        taken = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            text = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            text = "nvidia-smi did not answer within 30 s\n"
        path = folder / f"{label}.{view}.txt"
        path.write_text(f"$ {' '.join(command)}    # taken {taken}\n{text}")
        names.append(path.name)
    return names


def nvml_gpus() -> tuple[list[dict], Optional[str]]:
    """Every GPU NVML sees (index, name, total memory, UUID) and the driver version; ([], None) without NVML."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:  # no driver library: the caller says so where it matters
        return [], None
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gpus.append(dict(index=index, name=_text(pynvml.nvmlDeviceGetName(handle)),
                         memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                         uuid=_text(pynvml.nvmlDeviceGetUUID(handle))))
    return gpus, _text(pynvml.nvmlSystemGetDriverVersion())


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)  # older nvidia-ml-py returns bytes


class NvmlSeries(PeriodicSampler):
    """Every GPU's utilisation (%) and memory in use (bytes), at start and every `interval` seconds; each sample's time
    is in seconds since `zero` (a time.monotonic() value: the start of the whole proof, so the series of consecutive
    runs line up). `error` says why the series is empty or stopped short."""

    def __init__(self, zero: float, interval: float = 1.0):
        super().__init__(interval, "nvml-series")
        self.zero = zero
        self.error: Optional[str] = None
        self._handles: list = []

    def before_first(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:  # no driver library, old driver: the result says why the series is empty
            self.error = f"NVML: {type(e).__name__}: {e}"
            return False
        self.samples.extend(self.sample())
        return True

    def sample(self) -> list[dict]:
        import pynvml

        now, samples = round(time.monotonic() - self.zero, 2), []
        for index, handle in enumerate(self._handles):
            try:
                samples.append(dict(time_s=now, gpu=index,
                                    util_percent=float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                                    memory_used_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)))
            except pynvml.NVMLError as e:  # a GPU that stops answering: keep the others, say why once
                self.error = self.error or f"NVML: {e}"
        return samples


class RunMonitor:
    """Everything recorded around one run: the NVML series and nvidia-smi's CSV log (`<label>.nvidia-smi.csv` in
    `folder`) while it lasts. `recording` holds what was recorded (times in seconds since `zero`, file names relative
    to `folder`)."""

    def __init__(self, folder: Path, label: str, zero: float):
        self.folder, self.label, self.zero = folder, label, zero
        self.series = NvmlSeries(zero)
        self.csv = NvidiaSmiLog(folder / f"{label}.nvidia-smi.csv")
        self.recording: dict = {}

    def __enter__(self) -> RunMonitor:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._started = time.monotonic()
        self.series.start()
        self.csv.start()
        return self

    def __exit__(self, *exc) -> None:
        samples = self.series.stop()
        self.csv.stop()
        self.recording = dict(
            started_s=round(self._started - self.zero, 1),
            seconds=round(time.monotonic() - self._started, 1),
            nvml_series=samples,
            nvml_error=self.series.error,
            nvidia_smi_csv=self.csv.path.name if self.csv.path is not None else None,
        )
