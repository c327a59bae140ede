"""A measured profile as planning reads it: per-layer times, the optimizer step, the links of a
real run's mesh, whole steps of that layout at two depths and, where asked for, the profiled
model's own step at the splits the plan ranks best. `python -m holmes_jax.profile` measures one;
this record needs no JAX."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from holmes_jax.config import ConfigError
from holmes_jax.planning.topology import Link


def _link_json(link: Link | None) -> dict | None:
    # bytes_per_s round-trips exactly; gbps is for people reading the file (and older profiles)
    return None if link is None else {"gbps": link.gbps, "bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s}


def _json_link(raw: dict | None) -> Link | None:
    if raw is None:  # null only: a 0 or "" is a damaged link, not an unmeasured one
        return None
    return Link(raw["bytes_per_s"] if "bytes_per_s" in raw else raw["gbps"] * 1e9 / 8, raw["latency_s"])


def _json_probe(raw: dict) -> "StepProbe":
    return StepProbe(**dict(raw, stage_layers=tuple(raw["stage_layers"])))


LINK = 'a table {"bytes_per_s": N, "latency_s": N} (or "gbps" for bytes_per_s), or null'
PROBE = "a table of stage_layers (a list), dp, tp, microbatches, schedule and step_s"
# the fields read as lists: how each item is read, and what an item may be
LISTS = {"data_links": (_json_link, LINK), "stage_links": (_json_link, LINK),
         "stage_layer_scale": (lambda x: x, "a number in (0, 1]"),  # planning checks the numbers
         "step_probes": (_json_probe, PROBE), "split_probes": (_json_probe, PROBE)}


def _json_list(where: str, key: str, raw) -> tuple:
    """The list field `key` read item by item; a malformed one is a ConfigError naming it."""
    read, allowed = LISTS[key]
    if not isinstance(raw, list):
        raise ConfigError(f"{where}: {key} = {raw!r} is not allowed; allowed: a list, each item {allowed}")
    items = []
    for i, item in enumerate(raw):
        try:
            items.append(read(item))
        except (TypeError, ValueError, KeyError):  # a string or a list where a table belongs, a key missing
            raise ConfigError(f"{where}: {key}[{i}] = {item!r} is not allowed; allowed: {allowed}") from None
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class StepProbe:
    """The real train step of the profiled layout on a model of `sum(stage_layers)` layers, split
    as `stage_layers` says: its median seconds."""

    stage_layers: tuple[int, ...]
    dp: int
    tp: int
    microbatches: int
    schedule: str
    step_s: float


def block_shape(cfg) -> dict:
    """What shapes one block's work, of a resolved ModelConfig: a profile's layer times hold for
    models whose blocks have this shape (their depth may differ)."""
    return {"hidden": cfg.hidden, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads or cfg.num_heads,
            "ffn_hidden": cfg.ffn_hidden, "mlp": cfg.mlp, "bias": bool(cfg.bias)}


@dataclasses.dataclass(frozen=True)
class Profile:
    device_kind: str
    micro_batch: int
    seq_len: int
    layer_fwd_flops: float  # XLA's count for one block, one microbatch
    layer_fwd_s: float
    layer_bwd_s: float
    data_links: tuple[Link | None, ...]  # per stage; None when the stage has one replica
    stage_links: tuple[Link, ...]  # per boundary s -> s + 1
    update_s_per_param: float = 0.0  # the optimizer step (older profiles lack it: not timed)
    # per stage: its layer time over the slowest stage's, timed without waiting for the others
    # (the layer times above are the slowest stage's); empty: every stage alike
    stage_layer_scale: tuple[float, ...] = ()
    step_probes: tuple[StepProbe, ...] = ()  # whole steps at two depths (older profiles: none)
    # the profiled model's own step at the splits the plan ranked fastest (`--splits`; default none)
    split_probes: tuple[StepProbe, ...] = ()
    # the profiled model's ModelConfig.compute_dtype and remat (older profiles: None, not recorded)
    compute_dtype: str | None = None
    remat: str | None = None
    # the profiled model's block_shape (older profiles: None, not recorded)
    block: dict | None = None

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        raw["data_links"] = [_link_json(l) for l in self.data_links]
        raw["stage_links"] = [_link_json(l) for l in self.stage_links]
        return json.dumps(raw, indent=2)

    @classmethod
    def load(cls, path: str | Path, setting: str = "profile") -> "Profile":
        """Reads a profile JSON file; errors name `setting`, what the user set to `path`
        (ParallelConfig.profile, or plan's `profile`: the plan CLI's --profile), and the file."""
        where = f"{setting} {str(path)!r}"
        try:
            raw = json.loads(Path(path).expanduser().read_text())  # from a gin file, which no shell expands
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: brackets nested too deep
            raise ConfigError(f"{where}: not a readable holmes_jax profile ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: not a holmes_jax profile; allowed: a JSON table of its fields, "
                              f"as python -m holmes_jax.profile writes")
        for key in LISTS:
            if key in raw:  # a missing one: the class's default, or a missing field below
                raw[key] = _json_list(where, key, raw[key])
        try:
            return cls(**raw)
        except TypeError as e:  # a field missing, or one a profile does not have
            raise ConfigError(f"{where}: not a holmes_jax profile ({e})") from None
