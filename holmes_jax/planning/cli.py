"""`python -m holmes_jax.plan`: the command line of `holmes_jax.planning.plan`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from holmes_jax import cli
from holmes_jax.config import REMAT, ConfigError, ModelConfig, ParallelConfig
from holmes_jax.models import presets
from holmes_jax.planning import partition
from holmes_jax.planning.cost import SCHEDULES
from holmes_jax.planning.placement import PLACEMENTS
from holmes_jax.planning.contract import Plan
from holmes_jax.planning.search import DEFAULT_GLOBAL_BATCH, SEARCHABLE, plan

PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def _layer_list(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(p.strip().isdecimal() and int(p) > 0 for p in parts):  # isdigit took '²', which int() refuses
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: positive layer counts like 26,22")
    return tuple(int(p) for p in parts)


def _parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m holmes_jax.plan",
                description="Plan a mesh (stage, data, tensor), layers per stage and a schedule for a model on a "
                            "topology; print the plan and its predicted step time. Sizes left out are chosen by "
                            "the cost model.")
    p.add_argument("--topology", required=True, type=cli.path, help="topology TOML file (see configs/topologies)")
    p.add_argument("--model", required=True, help=f"preset: {', '.join(presets.PRESETS)}")
    for name in ("tp", "pp", "dp", "microbatches"):
        p.add_argument(f"--{name}", type=cli.positive_int, help="default: chosen by the cost model")
    p.add_argument("--global-batch", type=cli.positive_int, default=DEFAULT_GLOBAL_BATCH,
                   help=f"sequences per step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--seq-len", type=cli.positive_int, help="default: the model's max_seq_len")
    p.add_argument("--partition", choices=partition.METHODS, default="auto",
                   help="how layers are split over the stages (default auto: the fastest predicted)")
    p.add_argument("--stage-layers", type=_layer_list, help="layers per stage, e.g. 26,22 (wins over --partition)")
    p.add_argument("--placement", choices=PLACEMENTS, default="holmes",
                   help="which devices hold which stage (default holmes)")
    p.add_argument("--schedule", choices=SCHEDULES, help="default: chosen by the cost model")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activation dtype (default float32)")
    p.add_argument("--remat", nargs="?", const="full", default="none", choices=REMAT,
                   help="what each block's backward recomputes: none (default), full (--remat alone), dots")
    p.add_argument("--allow-mixed", action="store_true", help="let a stage span clusters instead of refusing")
    p.add_argument("--profile", type=cli.path,
                   help="measured profile JSON (python -m holmes_jax.profile) for layer times and link figures "
                        "instead of the topology's defaults")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--draw", type=cli.path, metavar="FILE.png",
                   help="also draw the plan: the step's timeline per stage and the placement on the clusters "
                        "(.png, .svg or .pdf)")
    return p


def main(argv: list[str], draw: Callable[[Plan, str], None] | None = None) -> int:
    """The plan command; `draw(plan, path)` draws pictures for --draw (holmes_jax.plan passes one
    that imports holmes_jax.pictures, which needs matplotlib, kept out of this package)."""
    args = _parser().parse_args(argv)
    if args.draw is not None:
        if draw is None:
            raise ConfigError("--draw is not available here; run python -m holmes_jax.plan --draw FILE.png")
        if Path(args.draw).suffix.lower() not in PICTURE_SUFFIXES or not Path(args.draw).parent.is_dir():
            raise ConfigError(f"--draw {args.draw!r} is not allowed; allowed: a file ending in "
                              f"{', '.join(PICTURE_SUFFIXES)} in an existing folder")
    given = {name: getattr(args, name) for name in SEARCHABLE}
    if args.stage_layers and given["pp"] is not None and len(args.stage_layers) != given["pp"]:
        # in the flags' words: ParallelConfig would name its own fields
        raise ConfigError(f"--stage-layers {','.join(map(str, args.stage_layers))} is not allowed with --pp "
                          f"{given['pp']}; allowed: {given['pp']} layer counts, one per stage (or leave --pp out)")
    pp = given["pp"] or (len(args.stage_layers) if args.stage_layers else 1)
    parallel = ParallelConfig(tp=given["tp"] or 1, pp=pp, dp=given["dp"], microbatches=given["microbatches"] or 1,
                              stage_layers=args.stage_layers, partition=args.partition,
                              schedule=given["schedule"] or "gpipe", placement=args.placement)
    model = ModelConfig(preset=args.model, compute_dtype=args.dtype, remat=args.remat)
    result = plan(args.topology, model, parallel, global_batch=args.global_batch, seq_len=args.seq_len,
                  auto=[name for name, value in given.items() if value is None], allow_mixed=args.allow_mixed,
                  profile=args.profile)
    print(result.to_json() if args.json else result.explain())
    if args.draw is not None:
        draw(result, args.draw)
    return 0
