"""Every test process sees 8 CPU devices, set before any JAX backend starts.

Many tests compile the same small programs, in this process, in the other pytest-xdist worker and
in the `python -m holmes_jax.*` processes they start (which inherit the environment): one
compilation cache for the session compiles each program once. The folder is new for every session
(made by the process that starts the workers) and removed at its end, so no entry outlives the code
that made it.

Entries are read and written under JAX's file lock (a size limit set turns it on), so no process
reads another's half-written entry.

The tests' programs are tiny and compile far longer than they run, so LLVM's expensive passes are
left out of CPU compiles here: the programs and their numbers are the same, built about a fifth
faster. A run sets the flags only where XLA_FLAGS does not already say otherwise.
"""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

_IS_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_COMPILE_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] if _IS_WORKER else tempfile.mkdtemp(
    prefix="holmes-jax-tests-compile-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in _FAST_COMPILE if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    + os.environ.get("XLA_FLAGS", "").split())
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"  # the default, 1 s, skips most of ours
# With a size limit JAX locks the cache (filelock) around each read and write; without one it
# writes entries in place, and a process starting the same program (a job's other rank) could
# read half an entry: a warning on stderr, which tests of exact output would see.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(1 << 40)
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_compilation_cache_max_size", 1 << 40)


def pytest_sessionfinish(session, exitstatus):
    if not _IS_WORKER:  # the workers end first
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()
