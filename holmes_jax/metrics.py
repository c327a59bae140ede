"""Step metrics: tokens/s, TFLOPS per device (Megatron's formula), MFU; console and metrics.jsonl."""

from __future__ import annotations


def megatron_flops(batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """FLOPs of one training iteration by Megatron's formula (what the Holmes paper's TFLOPS use).

    With activation recompute: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h));
    without: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    """
    b, s, l, h, v = batch, seq_len, num_layers, hidden, vocab
    if recompute:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
