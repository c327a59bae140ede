"""Planning: topology + model -> Plan, with numpy and the standard library only (no JAX).

Rooms, lowest first: `topology` (clusters, NIC classes, the one `Link`), `workload` (what a model
costs), `schedule` (the tick table the runtime and the cost model both run), `placement` (the
device grid), `communicators` (the fabric each communicator of a grid runs over), `cost`
(step-time prediction), `partition` (layers -> stages), `measured` (a profile's record),
`contract` (the Plan), `search` (the layouts tried), `cli`.
"""

from holmes_jax.planning.contract import Plan
from holmes_jax.planning.search import plan
from holmes_jax.planning.topology import Topology, load as load_topology

__all__ = ["Plan", "Topology", "load_topology", "plan"]
