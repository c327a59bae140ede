"""`python -m holmes_jax.report WORKDIR [--out FILE.png]`: a run's loss and validation curves and its
measured step time against the plan's prediction, from WORKDIR/metrics.jsonl and WORKDIR/plan.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

from holmes_jax import cli, pictures
from holmes_jax.config import ConfigError
from holmes_jax.planning.cli import PICTURE_SUFFIXES


NUMBERS = ("loss", "step_time_s")  # what the report draws from every row, beside its step


def _row(line: str) -> dict | None:
    """The metrics row on `line`, or None when it is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: brackets nested too deep
        return None
    if not isinstance(row, dict):
        return None
    for key in ("loss", "val_loss"):  # a skipped step's loss is written null (older runs wrote NaN)
        if key in row and row[key] is None:
            row[key] = math.nan
    # what is drawn must be what it seems (a hand-edited "val_loss": "x" or "step": true was a
    # traceback, or drawn as step 1); a loss may be not finite, a step's time not
    if (_integer(row.get("step")) and all(_number(row.get(key)) for key in NUMBERS)
            and math.isfinite(row["step_time_s"]) and row["step_time_s"] >= 0
            and ("val_loss" not in row or _number(row["val_loss"]))
            and ("resumed_from" not in row or _integer(row["resumed_from"]))):
        return row
    return None


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_rows(workdir: Path) -> list[dict]:
    """metrics.jsonl's rows by step; where a step has two rows, the later one (a resumed run drops
    the rows it logs again, but a file written before it did holds both)."""
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        if any((workdir / name).is_file() for name in ("config.gin", "plan.json")):
            # a run writes these before it compiles, metrics.jsonl with its first logged step
            raise ConfigError(f"WORKDIR {str(workdir)!r} holds no metrics.jsonl yet: the run logged no step yet")
        raise ConfigError(f"WORKDIR {str(workdir)!r} holds no metrics.jsonl; allowed: the workdir of a run "
                          f"(TrainConfig.workdir)")
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")  # other bytes fail as a line that is no row
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from None
    lines, rows = text.splitlines(), {}
    for number, line in enumerate(lines, 1):
        if not line.strip():  # a blank line (a hand edit) holds no row; jq reads past it too
            continue
        row = _row(line)
        if row is None and number == len(lines) and not text.endswith("\n"):
            continue  # a last row cut short (a crash, a full disk): the rows before it still draw
        if row is None:
            raise ConfigError(f"{path}:{number} is not a metrics row (one JSON object with an integer "
                              f"'step' and the numbers {' and '.join(map(repr, NUMBERS))}, a step time not "
                              f"negative; where present, 'val_loss' a number and 'resumed_from' an integer)")
        rows[row["step"]] = row
    if not rows:
        raise ConfigError(f"{path} is empty: the run logged no step yet")
    return [rows[s] for s in sorted(rows)]


def predicted_step_s(workdir: Path) -> float | None:
    """The plan's predicted step time (train.run writes plan.json), or None for a run without one."""
    path = workdir / "plan.json"
    if not path.is_file():
        return None
    try:
        text = path.read_bytes()  # bytes that are not UTF-8 fail below, as no plan
    except OSError as e:  # as metrics.jsonl's (no permission): one line, not a traceback
        raise ConfigError(f"{path} cannot be read: {e.strerror}") from None
    try:
        predicted = float(json.loads(text)["predicted"]["step_time_s"])
    except (ValueError, KeyError, TypeError):
        predicted = None
    if predicted is None or not (math.isfinite(predicted) and predicted > 0):
        raise ConfigError(f"{path} is not a plan (python -m holmes_jax.plan --json): it needs a positive "
                          f"predicted step_time_s")
    return predicted


def main(argv: list[str]) -> int:
    p = cli.Parser(prog="python -m holmes_jax.report", description=__doc__)
    p.add_argument("workdir", type=cli.path, help="a run's TrainConfig.workdir")
    p.add_argument("--out", type=cli.path, help="the picture (.png, .svg or .pdf); default WORKDIR/report.png")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    rows, predicted = read_rows(workdir), predicted_step_s(workdir)  # first: a wrong WORKDIR is named as such
    out = Path(args.out) if args.out else workdir / "report.png"
    if out.suffix.lower() not in PICTURE_SUFFIXES or not out.parent.is_dir():
        raise ConfigError(f"--out {str(out)!r} is not allowed; allowed: a file ending in "
                          f"{', '.join(PICTURE_SUFFIXES)} in an existing folder")
    pictures.draw_report(rows, predicted, str(out), title=str(workdir))
    measured, first = pictures.typical_step_s(pictures.plan_run_rows(rows)), pictures.plan_from_step(rows)
    scale, unit = pictures.time_unit(measured)
    print(f"wrote {out}: steps {rows[0]['step']}-{rows[-1]['step']}, loss {rows[0]['loss']:.4g} -> "
          f"{rows[-1]['loss']:.4g}; step time {measured * scale:.4g} {unit} "
          + ("(median)" if first is None else f"(median of the run from step {first})")
          + (f", predicted {predicted * scale:.4g} {unit}" if predicted is not None else ", no plan.json to compare")
          + ("" if predicted is None or first is None else " (by its plan)"))
    return 0


if __name__ == "__main__":
    cli.run(main)
