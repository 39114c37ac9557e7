"""Helpers of the reward-server tests: a real `imagerl reward-server` process (python -m imagerl), and a plugin file
with a reward that sleeps reward.options.test_sleepy.sleep_s seconds per call."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

SLEEPY_PLUGIN = '''
import time

import torch

from imagerl.rewards import register_reward


@register_reward("test_sleepy")
class Sleepy:
    """The mean pixel, after sleeping reward.options.test_sleepy.sleep_s seconds: a slow reward."""

    @classmethod
    def check_config(cls, cfg):
        unknown = set(cfg.options.get("test_sleepy", {})) - {"sleep_s"}
        if unknown:
            raise ValueError(f"reward.options.test_sleepy: unknown settings {sorted(unknown)}; it takes sleep_s")

    def __init__(self, cfg, device):
        self.sleep_s = float(cfg.options.get("test_sleepy", {}).get("sleep_s", 0.0))

    def __call__(self, images_B3HW, prompts, metadata):
        time.sleep(self.sleep_s)
        return images_B3HW.float().mean(dim=(1, 2, 3))
'''


class ServerProcess:
    """`python -m imagerl reward-server --port 0 ARGS`; .url once it printed its address."""

    def __init__(self, *args: str, cwd: Path | None = None, timeout_s: float = 120.0):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "imagerl", "reward-server", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        self.url = None
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"reward-server did not start in {timeout_s} s: {''.join(self.output)}") from None
            if line is None:
                raise RuntimeError(f"reward-server exited: {''.join(self.output)}")
            if " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
