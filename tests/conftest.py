"""Every test process sees 8 CPU devices, set before any JAX backend starts.

Many tests compile the same small programs, in this process and in the `python -m holmes_jax.*`
processes they start (which inherit the environment): one compilation cache for the session
compiles each program once. The folder is new for every session and removed at its end, so no
entry outlives the code that made it.
"""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)

_COMPILE_CACHE = tempfile.mkdtemp(prefix="holmes-jax-tests-compile-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILE_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"  # the default, 1 s, skips most of ours
jax.config.update("jax_compilation_cache_dir", _COMPILE_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()
