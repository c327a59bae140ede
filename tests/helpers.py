"""Small configs the tests share: a two-layer GPT that compiles in about a second."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from holmes_jax import configure

REPO = Path(__file__).resolve().parent.parent


def small_configs(tmp_path, *bindings: str) -> configure.Configs:
    """Configs for a quick run in `tmp_path`, with gin `bindings` ('--gin.X=Y') on top: one stage,
    one microbatch unless the bindings say otherwise."""
    base = [
        "--gin.ParallelConfig.pp=1", "--gin.ParallelConfig.microbatches=1", "--gin.ParallelConfig.schedule=gpipe",
        "--gin.ModelConfig.num_layers=2", "--gin.ModelConfig.hidden=64", "--gin.ModelConfig.num_heads=4",
        "--gin.ModelConfig.ffn_hidden=128", "--gin.DataConfig.seq_len=32", "--gin.DataConfig.global_batch=16",
        "--gin.TrainConfig.steps=6", "--gin.TrainConfig.log_every=1", "--gin.TrainConfig.eval_every=1000",
        f"--gin.TrainConfig.workdir={tmp_path}", "--gin.TrainConfig.learning_rate=0.01",
        "--gin.TrainConfig.warmup_steps=1",
    ]
    return configure.load_configs(base + list(bindings))


def strict_json(line: str):
    """`line` read as JSON proper: NaN and Infinity, which Python writes and jq refuses, raise."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(line, parse_constant=refuse)


def read_metrics(workdir) -> list[dict]:
    return [strict_json(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def run_module(module: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


# The session's compilation cache (tests/conftest.py), the one JAX_ setting a launched job keeps.
# JAX keys a multi-process program per process and only process 0 writes entries, so a job's
# process 0 reuses what an earlier job's process 0 compiled; the other ranks compile as before.
COMPILE_CACHE_SETTINGS = ("JAX_COMPILATION_CACHE_DIR", "JAX_COMPILATION_CACHE_MAX_SIZE",
                          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def launch_env() -> dict:
    """The environment for a `holmes_jax.launch` job: the package importable, and none of this
    process's own HOLMES_ and JAX_ settings (the launcher gives each rank its own; process ids,
    coordinator, platforms or device counts must not leak), but the compilation cache's."""
    return {k: v for k, v in dict(os.environ, PYTHONPATH=str(REPO)).items()
            if not k.startswith(("HOLMES_", "JAX_")) or k in COMPILE_CACHE_SETTINGS}


@contextlib.contextmanager
def hangup_as_at_a_terminal():
    """SIGHUP at its default while the block runs, as for a command started at a terminal: under
    `nohup` (the suite's own run, say) a command keeps ignoring it, and so does a process the block
    starts, which inherits the ignored signal."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


@contextlib.contextmanager
def killed_on_exit(process: subprocess.Popen):
    """`process`, killed and reaped if it still runs when the block ends: a failed assert or a
    timeout must not leave it behind (Popen's own `with` would wait for it)."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def load_bench(name: str):
    """bench/<name>.py as a module (bench/ is not a package), registered in sys.modules as a
    dataclass in it looks its module up there."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def lock_folder(monkeypatch, folder: Path) -> None:
    """`folder` reads as a folder without permission (mode 000) does for a user other than root:
    it cannot be listed, nor anything in it looked at. (Tests run as root, who reads it anyway.)"""
    folder = Path(folder)

    def denied(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and Path(path) != folder and Path(path).is_relative_to(folder)

    def looked_at(call):  # os.stat, os.lstat: a path inside is denied, the folder itself is not
        def locked(path, *args, **kwargs):
            if denied(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return call(path, *args, **kwargs)
        return locked

    def listed(call):  # os.scandir, os.listdir (Path.iterdir): the folder and what is inside are denied
        def locked(path="."):
            if isinstance(path, (str, os.PathLike)) and (Path(path) == folder or denied(path)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return call(path)
        return locked

    for name, wrap in (("stat", looked_at), ("lstat", looked_at), ("scandir", listed), ("listdir", listed)):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
