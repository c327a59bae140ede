"""The README's example outputs are what the current code prints (docs/readme_examples.py writes
them; the deterministic, quick ones are checked here), the docs' map of the code matches the
code, and the links between the docs resolve."""

import importlib.util
import re
import sys

import pytest

from helpers import REPO
from test_structure import import_graph

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


def _module_of(entry: str) -> str:
    """'pipeline/runtime.py' -> 'holmes_jax.pipeline.runtime'; 'planning/' -> 'holmes_jax.planning'."""
    return "holmes_jax." + entry.removesuffix("/").removesuffix(".py").replace("/", ".")


def _rooms() -> list[list[str]]:
    """docs/design.md's list of rooms, top first: the modules each line names."""
    text = (REPO / "docs" / "design.md").read_text()
    block = text.split("## Rooms", 1)[1].split("```\n", 2)[1]
    return [[_module_of(e) for e in re.match(r"[\w/.]+(?:, [\w/.]+)*", line).group().split(", ")]
            for line in block.splitlines() if line and not line.startswith(" ")]


def _room(module: str) -> str:
    """The room a module counts as: planning's modules are one room, 'planning/'."""
    return "holmes_jax.planning" if module.startswith("holmes_jax.planning") else module


def test_design_lists_every_module_and_imports_point_down_its_list():
    rank = {m: i for i, line in enumerate(_rooms()) for m in line}
    graph = import_graph()
    packages = {m for m in graph if (REPO / m.replace(".", "/") / "__init__.py").exists()}
    assert {_room(m) for m in graph} - packages - set(rank) == set(), "modules missing from docs/design.md's rooms"
    up = sorted(f"{m} -> {e}" for m in graph if _room(m) in rank for e in graph[m]
                if _room(e) in rank and rank[_room(e)] < rank[_room(m)])
    assert up == [], "imports pointing up docs/design.md's rooms"


def test_design_lists_planning_modules_lowest_first():
    text = (REPO / "docs" / "design.md").read_text()
    sentence = text.split("Inside it, lowest\nfirst:", 1)[1].split(".\n", 1)[0]
    graph = {m.removeprefix("holmes_jax.planning."): {e.removeprefix("holmes_jax.planning.") for e in edges}
             for m, edges in import_graph().items() if m.startswith("holmes_jax.planning.")}
    order = [name for name in re.findall(r"`(\w+)`", sentence) if name in graph]
    assert sorted(order) == sorted(graph)
    assert [f"{m} -> {e}" for i, m in enumerate(order) for e in sorted(graph[m] & set(order[i + 1:]))] == []


def test_the_readme_code_layout_names_every_module():
    words = set(re.findall(r"[\w/.]+", examples.README.read_text().split("## Layout of the code", 1)[1]))
    files = [p.relative_to(REPO) for p in (REPO / "holmes_jax").rglob("*.py") if p.name != "__init__.py"]
    # a top-level module by its path, a subpackage's on its folder's line ("runtime.py", "cost")
    missing = [str(f) for f in files if not ({str(f)} if len(f.parts) == 2 else {f.name, f.stem}) & words]
    assert missing == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_links_between_the_docs_resolve():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M) if linked.is_file() else []
            if not linked.is_file() or (anchor and anchor not in map(_anchor, headings)):
                broken.append(f"{page.name}: {target}")
    assert broken == []


def test_uneven_counts_of_runs_match_its_table_of_runs():
    """docs/uneven.md's "in N of the M runs" sentences count the runs its table lists (they were
    left at 11 when runs 12-15 were added)."""
    text = (REPO / "docs" / "uneven.md").read_text()
    table = text.split("### Every run at roce 200 Mbit/s", 1)[1].split("\n- ", 1)[0]
    runs = len(re.findall(r"^\| \d+ \|", table, re.M))
    totals = [int(m) for m in re.findall(r"in \d+ of\s+(?:the\s+)?(\d+)\s+runs", text)]
    assert totals and runs
    assert set(totals) == {runs}


def test_data_prepare_example_prints_what_docs_data_shows(tmp_path, monkeypatch, capsys):
    """docs/data.md's stdlib-bpe example, run as the page shows it: prepare prints its first output line."""
    import sysconfig

    from holmes_jax import data

    text = (REPO / "docs" / "data.md").read_text()
    command = re.search(r"^python -m holmes_jax\.data (prepare \$STDLIB.*)$", text, re.M).group(1)
    shown = re.search(r"^data/stdlib-bpe: .*$", text, re.M).group()
    monkeypatch.chdir(tmp_path)
    assert data.main(command.replace("$STDLIB", sysconfig.get_paths()["stdlib"]).split()) == 0
    assert capsys.readouterr().out.strip() == shown


def _without_times(lines: list[str]) -> list[str]:
    """Plan lines with the figures that follow the device speed masked and the columns closed up."""
    timed = r"\d[\d.e+]*\s?(?:ms|us|s|samples/s|TFLOPS/device)(?![\w/])"
    return [" ".join(re.sub(timed, "T", line).split()) for line in lines]


def test_the_default_runs_plan_in_the_readme_is_what_the_planner_gives():
    """train-default is a slow example (docs/readme_examples.py refreshes it): its plan, but for the
    times, which follow the CPU peak measured at start-up, is checked here (its memory column went
    stale once when the cost model started counting the scan's buffers)."""
    import jax

    from holmes_jax import configure, planning
    from holmes_jax.mesh.devices import local_topology

    shown = examples.readme_blocks(examples.README.read_text())["train-default"].splitlines()
    peak = float(re.search(r"matmul peak of cpu \(([\d.]+) TFLOPS/device\)", "\n".join(shown)).group(1))
    cfgs = configure.load_configs([])
    topology = local_topology(jax.devices("cpu"), nic_class="ethernet", device_tflops=peak)
    plan = planning.plan(topology, cfgs.model, cfgs.parallel, global_batch=cfgs.data.global_batch,
                         seq_len=cfgs.data.seq_len)
    start = next(i for i, line in enumerate(shown) if line.startswith("plan:"))
    end = next(i for i, line in enumerate(shown) if line.startswith("partitions on this layout:"))
    assert _without_times(shown[start:end + 1]) == _without_times(plan.explain().splitlines()), (
        "README.md's example 'train-default' is stale: run python docs/readme_examples.py train-default")
