"""A real ``vllm-graft serve`` on 127.0.0.1 for the HTTP tests, and the HTTP calls
they make of it (the standard library's, as a client would)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.vllm.conftest import server_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def http_post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def http_post_status(url: str, body: dict) -> tuple[int, dict | str]:
    """A POST's status: 200 and the reply, or the error's status and body."""
    try:
        return 200, http_post(url, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def open_stream(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def read_stream_chunks(response, chunks: int | None = None) -> list[str]:
    """The texts of the next ``chunks`` streamed completion chunks (all that are left
    when ``None``, up to ``[DONE]`` or the server closing the stream)."""
    texts = []
    while chunks is None or len(texts) < chunks:
        line = response.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            texts.append(json.loads(line[len(b"data: "):])["choices"][0]["text"])
    return texts


def disconnect_mid_stream(url: str, body: dict, chunks: int) -> int:
    """Read ``chunks`` streamed chunks of a completion, then hang up; how many came."""
    response = open_stream(url, body)
    read = len(read_stream_chunks(response, chunks))
    response.close()
    return read


class ServedModel:
    """``vllm-graft serve MODEL`` on a free port of 127.0.0.1, in float32 and eager
    mode, with the speculative config file ``config`` (plain decoding without one) and
    any ``args`` more; its output goes to ``log_path``. Started at construction; as a
    context manager, ready on entry (:meth:`wait_ready`) and stopped on exit
    (:meth:`stop`)."""

    def __init__(self, model: Path | str, log_path: Path, config: Path | None = None,
                 *args: str, max_model_len: int = 512, env: dict[str, str] | None = None):
        self.model, self.log_path, self.port = str(model), log_path, free_port()
        command = [sys.executable, "-m", "vllm_graft.cli.main", "serve", self.model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                   "--max-model-len", str(max_model_len), "--enforce-eager", *args]
        if config is not None:
            command += ["--speculative-config", str(config)]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=server_env() if env is None else env,
                                        start_new_session=True)
        self.terminated = False

    def wait_ready(self, timeout: float = 240) -> ServedModel:
        """Until ``/health`` answers 200; fails with the log's tail if the server exits,
        or after ``timeout`` seconds."""
        deadline = time.time() + timeout
        while True:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if http_get(f"{self.base}/health")[0] == 200:
                    return self
            except OSError:
                pass
            assert time.time() < deadline, f"server not ready in {timeout} s"
            time.sleep(0.5)

    def complete(self, **body) -> tuple[int, dict | str]:
        """``/v1/completions`` of the served model (:func:`http_post_status`)."""
        return http_post_status(f"{self.base}/v1/completions", {"model": self.model, **body})

    def alive(self) -> bool:
        return self.process.poll() is None and http_get(f"{self.base}/health")[0] == 200

    def terminate(self) -> None:
        """SIGTERM to the API server, as a supervisor stops it (it shuts its engine
        down)."""
        os.kill(self.process.pid, signal.SIGTERM)
        self.terminated = True

    def stop(self, timeout: float = 60) -> int:
        """Terminated (unless it was) and waited for; its whole process group killed
        after ``timeout`` seconds. Returns its exit code."""
        if not self.terminated and self.process.poll() is None:
            self.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        return self.process.returncode

    def __enter__(self) -> ServedModel:
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()
