"""Rewrites the README's example outputs from the current code, so they cannot go stale.

Each block of README.md between `<!-- example: NAME -->` and `<!-- /example -->` is the command
of EXAMPLES[NAME] and what it prints now:

    python docs/readme_examples.py                  # run every example, rewrite its block
    python docs/readme_examples.py plan-ib4roce4    # only these
    python docs/readme_examples.py --check          # exit 1 naming the blocks that differ

The plan and bench examples are deterministic and quick (tests/test_readme.py checks them); the
training runs take minutes and their timings vary, so only this script refreshes them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BLOCK = re.compile(r"(<!-- example: (\S+) -->\n)(.*?)(<!-- /example -->)", re.DOTALL)


def _whole(lines: list[str]) -> list[str]:
    return lines


def _train_run(lines: list[str]) -> list[str]:
    """Everything before the first step line, then the last step line and the summary."""
    first = next(i for i, line in enumerate(lines) if line.startswith("step "))
    return lines[:first] + ["..."] + lines[-2:]


def _text_to_model(lines: list[str]) -> list[str]:
    """Up to the plan, then from the last step line on (the summary and the later commands)."""
    plan = next(i for i, line in enumerate(lines) if line.startswith("plan:"))
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    return lines[:plan] + ["..."] + lines[last_step:]


@dataclasses.dataclass(frozen=True)
class Example:
    command: str  # as the README shows it, run from the repository root
    fast: bool  # deterministic and quick: the test checks it
    trim: Callable[[list[str]], list[str]] = _whole
    extra: tuple[str, ...] = ()  # arguments the run adds but the README leaves out
    script: bool = False  # a bash script, run in an empty folder, not a command in the repository


EXAMPLES = {
    "plan-ib4roce4": Example(
        "python -m holmes_jax.plan --topology configs/topologies/ib4_roce4.toml --model 7.5b --tp 8 --pp 2", True),
    "paper-scenarios": Example("python bench/paper_scenarios.py", True),
    "train-default": Example("python -m holmes_jax.train", False, _train_run, ("--gin.TrainConfig.workdir={tmp}",)),
    "text-to-model": Example(
        """STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
holmes-data prepare $STDLIB/email --out data --tokenizer bpe:2048   # train a 2048-token BPE, tokenize
holmes-train --gin.DataConfig.source=data --gin.TrainConfig.steps=60 --gin.TrainConfig.workdir=run
holmes-generate --workdir run --prompt "def " --max-tokens 40 --greedy
holmes-report run --out report.png         # loss curves, step time against the plan's prediction
holmes-export --workdir run --out hf       # a Hugging Face folder: GPT2LMHeadModel for this GPT-2-style model""",
        False, _text_to_model, script=True),
}


def output(name: str) -> str:
    """What EXAMPLES[name] prints now, trimmed as the README shows it."""
    example = EXAMPLES[name]
    with tempfile.TemporaryDirectory() as tmp:  # the run's workdir: nothing lands in the repository
        if example.script:
            argv, cwd = ["bash", "-e", "-c", example.command], tmp
        else:
            argv = [sys.executable] + example.command.split()[1:] + [a.format(tmp=tmp) for a in example.extra]
            cwd = REPO
        result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=3600,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
    if result.returncode:
        raise RuntimeError(f"{example.command} failed ({result.returncode}):\n{result.stderr}")
    return "\n".join(line.rstrip() for line in example.trim(result.stdout.rstrip("\n").splitlines()))


def block(name: str) -> str:
    """The README block of EXAMPLES[name]: its command, then its output."""
    return f"```bash\n{EXAMPLES[name].command}\n```\n```\n{output(name)}\n```\n"


def readme_blocks(text: str) -> dict[str, str]:
    return {m.group(2): m.group(3) for m in BLOCK.finditer(text)}


def main(argv: list[str]) -> int:
    check = "--check" in argv
    names = [a for a in argv if a != "--check"] or list(EXAMPLES)
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        print(f"error: unknown example {unknown[0]!r}; allowed: {', '.join(EXAMPLES)}", file=sys.stderr)
        return 2
    text = README.read_text()
    missing = [n for n in names if n not in readme_blocks(text)]
    if missing:
        print(f"error: README.md has no block <!-- example: {missing[0]} -->", file=sys.stderr)
        return 2
    fresh = {name: block(name) for name in names}
    text = README.read_text()  # again: the README may have been edited while the examples ran
    if check:
        stale = [n for n in names if readme_blocks(text)[n] != fresh[n]]
        print("stale: " + ", ".join(stale) if stale else "README examples are current")
        return 1 if stale else 0
    README.write_text(BLOCK.sub(lambda m: m.group(1) + fresh.get(m.group(2), m.group(3)) + m.group(4), text))
    print(f"rewrote {', '.join(names)} in README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
