"""What a training process measures about itself while it runs: CPU and GPU utilisation every second, and its peak
memory at the end."""

from __future__ import annotations

import resource
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

import psutil
import torch

from hivetrain.run_result import RankMemory, UtilisationSample
from hivetrain.sampling import PeriodicSampler


def _nvml_handle(device: torch.device):
    """NVML's handle for the GPU torch calls `device`; matched by UUID because CUDA_VISIBLE_DEVICES renumbers GPUs."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
    return pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)


class UtilisationSampler(PeriodicSampler):
    """This process's CPU %, the machine's CPU % and RSS (and its GPU's utilisation and memory through NVML), every
    `interval` seconds."""

    def __init__(self, rank: int, device: torch.device, interval: float = 1.0):
        super().__init__(interval, "utilisation-sampler")
        self.rank = rank
        self._process = psutil.Process()
        self._gpu = None
        if device.type == "cuda":
            try:
                self._gpu = _nvml_handle(device)
            except Exception as e:  # no driver library, old driver: keep sampling the CPU side
                print(f"warning: no GPU utilisation samples (NVML: {e})", flush=True)

    def before_first(self) -> bool:
        self._started = time.monotonic()
        self._process.cpu_percent(None)  # the first call only sets the reference point
        self._last_times = psutil.cpu_times()
        return True

    def sample(self) -> list[UtilisationSample]:
        gpu_util = gpu_memory = None
        if self._gpu is not None:
            import pynvml

            gpu_util = float(pynvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
            gpu_memory = int(pynvml.nvmlDeviceGetMemoryInfo(self._gpu).used)
        return [UtilisationSample(
            time_s=round(time.monotonic() - self._started, 3),
            rank=self.rank,
            cpu_percent=self._process.cpu_percent(None),
            system_cpu_percent=self._system_cpu_percent(),
            rss_bytes=self._process.memory_info().rss,
            gpu_util_percent=gpu_util,
            gpu_memory_bytes=gpu_memory,
        )]

    def _system_cpu_percent(self) -> float:
        # Our own reference point: psutil.cpu_percent(None) shares one with every other caller in the process.
        now = psutil.cpu_times()
        total = sum(now) - sum(self._last_times)
        before = self._last_times
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
        self._last_times = now
        return round(100.0 * (1 - idle / total), 1) if total > 0 else 0.0


class NvidiaSmiLog:
    """`nvidia-smi --query-gpu=... -l 1` written to a CSV file for the whole run: the raw view of every GPU of this
    node, next to our own per-rank samples. Does nothing when the binary is missing."""

    QUERY = ("timestamp,index,name,utilization.gpu,utilization.memory,memory.used,memory.total,power.draw,"
             "temperature.gpu")

    def __init__(self, path: Path):
        self.path: Optional[Path] = path if shutil.which("nvidia-smi") else None
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as out:  # the child keeps its own handle
            self._proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv", "-l", "1"],
                                          stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def peak_memory(rank: int, device: torch.device) -> RankMemory:
    """Peak RSS of this process since it started (getrusage: the kernel's high-water mark, not a sample) and, on a
    GPU, the most memory torch allocated on it."""
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return RankMemory(rank=rank, host=socket.gethostname(), peak_rss_bytes=peak_rss, peak_gpu_bytes=peak_gpu)

