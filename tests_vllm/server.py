"""``vllm serve DIR`` on 127.0.0.1 for the tests: started as the CLI runs it (``vllm_serve.py``), waited for,
and killed with its process group at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import requests

START_TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir, log_path: Path, *extra: str, max_model_len: Optional[int] = 1024) -> Iterator[str]:
    """The server's URL while ``vllm serve model_dir`` (float32, a small KV cache, eager, seed 0, ``max_model_len``
    (None: the model's own), ``extra`` flags) runs; its output goes to ``log_path``."""
    port = _free_port()
    log = open(log_path, "w")
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "vllm_serve.py"), str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.1",
               "--enforce-eager", "--seed", "0", *extra]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}; see {log.name}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve did not answer within {START_TIMEOUT} s; see {log.name}")
            time.sleep(2)
        yield url
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(timeout=30)
        log.close()
