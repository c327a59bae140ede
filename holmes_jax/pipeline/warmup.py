"""Communicators between clusters, created over sockets before the first step.

NCCL chooses a communicator's network when the communicator is created, from NCCL_NET as it is at
that moment; XLA creates a communicator (a clique) the first time a program runs a collective
over its devices, and every later program whose collective has the same clique key reuses it.
Clusters joined only by Ethernet cannot reach each other over NCCL's IB transport, so every
collective of the step whose devices span clusters must get a socket communicator, and every
other one keeps the RDMA network of its class. `warm_up` runs, before the first step and with
NCCL_NET=Socket, one program holding collectives over exactly the step's groups that span
clusters: the boundary hops' ppermutes (the runtime keeps them apart from the other hops) and
sums over the mesh axes whose groups the step reduces across clusters (the tied embedding's
gradient and the loss over `stage`, the global gradient norm, and the gradient reductions of
data groups that span clusters, as the naive placement's do). NCCL_NET is put back afterwards,
and the step's other collectives are created later under the host's own network. The XLA flags
in `distributed.XLA_NETWORK_FLAGS` make this hold: clique keys are the devices, and nothing is
split from a parent created on another network (docs/nccl.md).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from holmes_jax import distributed
from holmes_jax.mesh import nic
from holmes_jax.planning.placement import AXES

_OP = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute|collective-broadcast)"
                 r"(?:-start)?\(")
_LIST = re.compile(r"(replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                   r"\{([^}]*)\}")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(_ints(perm)) if perm else ids


def _groups(line: str):
    """The device groups of one collective's HLO line; ValueError where its format is not known."""
    if m := _LIST.search(line):
        return tuple(tuple(_ints(g.strip("{}"))) for g in m.group(2).split("},{"))
    if m := _IOTA.search(line):
        return _iota(_ints(m.group(3)), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
    if m := _MESH.search(line):
        names, sizes = zip(*(a.split("=") for a in m.group(1).replace("'", "").split(",")))
        sizes = [int(s) for s in sizes]
        ids = _iota(_ints(m.group(2)), m.group(3)).reshape(sizes) if m.group(2) else _iota(sizes, None)
        chosen = [names.index(a.strip().strip("'")) for a in m.group(4).split(",")]
        rest = [i for i in range(len(sizes)) if i not in chosen]
        return ids.transpose(rest + chosen).reshape(-1, int(np.prod([sizes[i] for i in chosen])))
    raise ValueError("no known group format")


def collectives(hlo: str) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """(op, groups) of each collective in compiled HLO text, as device positions in the mesh
    (flattened (stage, data, tensor) order). A collective-permute's groups are its
    (source, target) pairs; an unreadable group format (an unknown one, or a known one that does
    not add up) raises ValueError naming the line."""
    found = []
    for line in hlo.splitlines():
        op = _OP.search(line)
        if not op:
            continue
        try:
            groups = _groups(line)
        except ValueError:
            raise ValueError(f"cannot read the groups of: {line.strip()[:200]}") from None
        found.append((op.group(1), tuple(tuple(int(i) for i in g) for g in groups)))
    return found


def _spans(group, clusters: np.ndarray) -> bool:
    return len({int(clusters[i]) for i in group}) > 1


def axis_groups(shape: tuple[int, ...], axes: tuple[str, ...]) -> set[frozenset]:
    """The device groups of a collective over mesh `axes` of a (stage, data, tensor) mesh."""
    chosen = [AXES.index(a) for a in axes]
    rest = [i for i in range(3) if i not in chosen]
    ids = np.arange(int(np.prod(shape))).reshape(shape).transpose(rest + chosen)
    return {frozenset(map(int, g)) for g in ids.reshape(-1, int(np.prod([shape[i] for i in chosen])))}


def reduction_axes(hlo: str, shape: tuple[int, ...], clusters: np.ndarray) -> tuple[tuple[tuple[str, ...], ...], set]:
    """The mesh-axis sets whose sums rebuild the step's non-permute groups that span clusters,
    and the spanning groups no axis set rebuilds (empty when all are covered). `clusters`: the
    cluster of each mesh position."""
    needed = {frozenset(g) for op, groups in collectives(hlo) if op != "collective-permute"
              for g in groups if _spans(g, clusters)}
    chosen, covered = [], set()
    for r in (1, 2, 3):
        for axes in itertools.combinations(AXES, r):
            if any(shape[AXES.index(a)] == 1 for a in axes):
                continue
            groups = axis_groups(shape, axes)
            # The warm-up's sum puts every group of `axes` on sockets. Sums without `stage` hold
            # gradient reductions (data groups spanning clusters: the naive placement), so they
            # are taken only where every group spans clusters: none inside a cluster slows down.
            if groups & needed and ("stage" in axes or all(_spans(g, clusters) for g in groups)):
                chosen.append(axes)
                covered |= groups & needed
    return tuple(chosen), needed - covered


def program(setup, hlo: str, say=print):
    """(jitted warm-up program, its input) for a built run and its compiled step's HLO; None when
    no collective of the step spans clusters."""
    mesh, plan = setup.mesh, setup.plan
    clusters = plan.topology.device_cluster[plan.grid.ravel()]
    if len(set(clusters.tolist())) == 1:  # one cluster: nothing spans clusters, no need to read the HLO
        return None
    try:
        axes_sets, missed = reduction_axes(hlo, tuple(mesh.devices.shape), clusters)
    except ValueError as e:  # a group format this reader does not know (a newer XLA): warm the hops only
        axes_sets, missed = (), set()
        say(f"warning: {e}; the step's sums across clusters get the host's own NCCL_NET")
    hops = setup.pipeline.boundary_warmup(plan.micro_batch, setup.cfgs.data.seq_len)
    if missed:
        say(f"warning: the step reduces over device groups {sorted(map(sorted, missed))[:4]} spanning clusters that "
            "no mesh axes rebuild; their communicators get the host's own NCCL_NET")
    if hops is None and not axes_sets:
        return None

    def sums(x):
        return jnp.stack([lax.psum(x, axes) for axes in axes_sets]).reshape((1,) * 3 + (-1,))

    def run(x, one):
        out = [] if hops is None else [hops[0](x)]
        if axes_sets:
            spec = P(*AXES)
            out.append(jax.shard_map(sums, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(one))
        return out

    one = None
    if axes_sets:
        one = jax.device_put(jnp.ones(mesh.devices.shape, jnp.float32), NamedSharding(mesh, P(*AXES)))
    return jax.jit(run), (None if hops is None else hops[1], one)


def _run(compiled, args):
    """Runs the warm-up and waits for it: the communicators exist once it returns."""
    return jax.block_until_ready(compiled(*args))


def warm_up(setup, hlo: str, say=print) -> bool:
    """Creates the step's cross-cluster communicators with NCCL_NET=Socket, then restores NCCL_NET.
    Returns whether there was anything to create."""
    if setup.mesh.devices.flat[0].platform == "gpu":
        for line in distributed.network_lines():
            say(f"network: {line}")
    built = program(setup, hlo, say)
    if built is None:
        return False
    fn, args = built
    compiled = fn.lower(*args).compile()
    with nic.over_sockets():
        _run(compiled, args)
    hops = setup.pipeline.boundary_hops
    say(f"network: communicators across clusters created over sockets (stage hops "
        f"{', '.join(f'{s}->{s + 1}' for s in hops) or 'none'}{'; sums over mesh axes' if args[1] is not None else ''})")
    return True
