"""The optimizer: AdamW on a warm-up then decay schedule, clipped by the global gradient norm."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from holmes_jax.config import TrainConfig


def make_schedule(tcfg: TrainConfig) -> optax.Schedule:
    """The learning rate of each update, by optax's count (the updates already made, 0 for the
    first; a checkpoint restores it). Update n = count + 1 warms up linearly to the peak,
    `learning_rate * n / warmup_steps`, so step 1 already moves the weights and step
    `warmup_steps` is at the peak; it then decays (cosine, or linear over the last `decay_fraction`
    of the steps for wsd) to the floor `learning_rate * min_lr_ratio`, reached at step `steps` and
    held after it; constant stays at the peak. Where the warm-up does not end before `steps`, it
    rises for the whole run and never decays."""
    peak, floor = tcfg.learning_rate, tcfg.learning_rate * tcfg.min_lr_ratio
    warmup = max(tcfg.warmup_steps, 1)  # 0 or 1: the first update is at the peak
    decay_start = warmup  # the last update at the peak
    if tcfg.lr_schedule == "wsd":
        decay_start = max(warmup, tcfg.steps - max(1, round(tcfg.decay_fraction * tcfg.steps)))
    decay_steps = tcfg.steps - decay_start if tcfg.lr_schedule != "constant" else 0

    def schedule(count):
        update = count + 1
        warm = peak * jnp.minimum(update / warmup, 1.0)
        if decay_steps <= 0:
            return warm
        progress = jnp.clip((update - decay_start) / decay_steps, 0.0, 1.0)
        # `left` is exactly 0 at progress 1 (float32's cos of pi rounds to -1): step `steps` is at the floor
        left = 0.5 * (1 + jnp.cos(math.pi * progress)) if tcfg.lr_schedule == "cosine" else 1 - progress
        return jnp.where(update <= decay_start, warm, floor + (peak - floor) * left)

    return schedule


def make_optimizer(tcfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on `make_schedule`. Gradient clipping is not chained in: the train step
    (`holmes_jax.pipeline.update.make_update`) clips by the one global norm it also reports, summed
    over the mesh (a chained clip beside a separately computed norm for the metrics made the step
    about 30 ms slower on the 4-process emulated testbed). `apply_gradients` is that update on one
    device, unsharded."""
    schedule = make_schedule(tcfg)

    def decay_mask(params):  # weight decay on matmul kernels and embeddings (tokens, learned positions) only
        return jax.tree_util.tree_map_with_path(
            lambda path, _: getattr(path[-1], "key", "") in ("kernel", "embedding", "positions"), params)

    tx = optax.adamw(schedule, b1=tcfg.beta1, b2=tcfg.beta2, weight_decay=tcfg.weight_decay, mask=decay_mask)
    return tx, schedule


def clip_gradients(grads, max_norm: float):
    """(grads scaled down to global norm `max_norm` where it is above, their global norm)."""
    norm = optax.tree.norm(grads)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def apply_gradients(tx, max_norm: float, params, opt_state, grads):
    """One optimizer step: clip, update, apply. Returns
    (params, opt_state, the gradients' global norm before clipping)."""
    grads, norm = clip_gradients(grads, max_norm)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, norm
