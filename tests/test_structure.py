"""The package's shape: imports point one way (no cycle, function-level imports included), and
planning runs without JAX."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "holmes_jax"
# What the JAX-free planning package may import from holmes_jax besides itself.
PLANNING_MAY_IMPORT = {"holmes_jax", "holmes_jax.cli", "holmes_jax.config", "holmes_jax.models",
                       "holmes_jax.models.presets"}
# The library's rooms (the model, its state's layout and update, the pipeline, the mesh, the planner)
# and the modules that run or serve a run (the commands, the loop, files on disk): the first never
# import the second.
LIBRARY = ("models", "sharding", "optimizer", "pipeline", "mesh", "planning")
RUN_LEVEL = ("build", "train", "profile", "configure", "data", "prepare", "checkpoint", "export", "inference",
             "generate", "report", "plan", "launch", "emulate", "scripts", "metrics", "guard", "pictures")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the holmes_jax modules it imports anywhere in its source (functions included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "holmes_jax.train" in graph and "holmes_jax.build" in graph["holmes_jax.train"]
    assert "holmes_jax.train" in graph["holmes_jax.profile"]  or "holmes_jax.build" in graph["holmes_jax.profile"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_planning_imports_point_down_only():
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("holmes_jax.planning"):
            outside = {e for e in edges if not e.startswith("holmes_jax.planning")} - PLANNING_MAY_IMPORT
            assert not outside, f"{name} imports {outside}"


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_library_rooms_do_not_import_the_run_level():
    graph = import_graph()
    assert set(LIBRARY + RUN_LEVEL) <= {_room(m) for m in graph}, "a room named here is gone: update the lists"
    for name, edges in graph.items():
        if _room(name) in LIBRARY:
            upward = {e for e in edges if _room(e) in RUN_LEVEL}
            assert not upward, f"{name} imports {upward}"


def test_planning_runs_with_jax_blocked(tmp_path):
    topology = PACKAGE.parent / "configs" / "topologies" / "ib4_roce4.toml"
    code = f"""
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"):
            raise ImportError("blocked: " + name)

sys.meta_path.insert(0, Block())
import holmes_jax
from holmes_jax.planning import plan
from holmes_jax.planning.cli import main
p = holmes_jax.plan({str(topology)!r}, "7.5b")
assert p.pp > 1 and set(p.to_dict()["stage_nic"]) == {{"infiniband", "roce"}}, p.to_dict()["stage_nic"]
assert main(["--topology", {str(topology)!r}, "--model", "3.6b", "--pp", "2", "--json"]) == 0
assert not any(m.split(".")[0] in ("jax", "flax", "optax") for m in sys.modules)
print("planned without jax")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "planned without jax" in r.stdout
