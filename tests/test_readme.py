"""The README's example outputs are what the current code prints (docs/readme_examples.py writes
them; the deterministic, quick ones are checked here)."""

import importlib.util
import sys

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("readme_examples", REPO / "docs" / "readme_examples.py")
examples = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = examples  # its dataclass looks its module up there
spec.loader.exec_module(examples)


def test_every_example_has_a_block_in_the_readme():
    assert set(examples.readme_blocks(examples.README.read_text())) == set(examples.EXAMPLES)


@pytest.mark.parametrize("name", [n for n, e in examples.EXAMPLES.items() if e.fast])
def test_the_readme_block_is_what_the_code_prints(name):
    assert examples.readme_blocks(examples.README.read_text())[name] == examples.block(name), (
        f"README.md's example {name!r} is stale: run python docs/readme_examples.py {name}")


def test_a_train_output_is_trimmed_to_its_start_and_summary():
    lines = ["holmes_jax: ...", "plan: ...", "step 1/3 | loss 5", "step 2/3 | loss 4", "step 3/3 | loss 3", "done: x"]
    assert examples._train_run(lines) == ["holmes_jax: ...", "plan: ...", "...", "step 3/3 | loss 3", "done: x"]
