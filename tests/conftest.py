"""Every test process sees 8 CPU devices, set before any JAX backend starts."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(autouse=True)
def _fresh_gin():
    import gin

    gin.clear_config()
    yield
    gin.clear_config()
