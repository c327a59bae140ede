"""Step metrics: tokens/s, TFLOPS per device (Megatron's formula), MFU; console and metrics.jsonl."""

from __future__ import annotations


def megatron_flops(batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int, recompute) -> float:
    """FLOPs of one training iteration by Megatron's formula (what the Holmes paper's TFLOPS use).

    With activation recompute: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h));
    without: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    `recompute`: a `ModelConfig.remat` policy or a bool. Only 'full' counts as recompute: Megatron's
    formula has no term for 'dots', which recomputes attention's s x s products only (the
    formula's s/(6h) share), so its TFLOPS are those of the work without recompute.
    """
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    if recompute in (True, "full"):
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


# Dense bf16 peak TFLOP/s of one device, by the start of `device.device_kind` (lower case).
_PEAK_TFLOPS = {"nvidia a100": 312.0, "nvidia h100": 989.0, "nvidia h200": 989.0, "nvidia h800": 989.0}


def device_peak_tflops(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((v for k, v in _PEAK_TFLOPS.items() if kind.startswith(k)), None)


def measure_matmul_peak_tflops(devices, size: int = 512, repeats: int = 5) -> float:
    """Achieved matmul TFLOP/s of one device when all `devices` multiply at once (they share the
    host's cores on CPU, so per-device peak is the aggregate over the count)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    a = jax.device_put(jnp.ones((len(devices), size, size), jnp.float32), sharding)
    mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=sharding)
    mm(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mm(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * size**3 / best / 1e12


class MetricsLog:
    """Appends one JSON object per logged step to `path` and, unless quiet, prints a progress line."""

    def __init__(self, path, total_steps: int, quiet: bool = False):
        self.path, self.total_steps, self.quiet = path, total_steps, quiet

    def write(self, row: dict) -> None:
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.quiet:
            return
        parts = [f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps}", f"loss {row['loss']:.4f}"]
        if "val_loss" in row:
            parts.append(f"val {row['val_loss']:.4f}")
        parts += [f"{row['step_time_s'] * 1e3:.0f} ms/step", f"{row['tokens_per_s']:,.0f} tok/s",
                  f"{row['tflops_per_device']:.3g} TFLOPS/dev"]
        if row.get("mfu") is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        print(" | ".join(parts), flush=True)
