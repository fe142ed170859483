"""Engine supervision: the node agent (launch, watch, restart, drain, adopt) and the checks
of external engines. The database row of each instance is the truth; this code moves it
from state to state and logs why."""

from workers.supervision.engine import (
    deployment_id,
    engine_check,
    engine_launch,
    engine_marker,
    engine_stop,
    launch_spec,
    restart_delay,
)
from workers.supervision.external import external_check, external_reconcile
from workers.supervision.node import (
    SupervisionClock,
    detect_engine_packages,
    detect_gpus,
    node_reconcile,
    node_stop_all,
    stop_orphans,
    this_node,
)

__all__ = [
    "SupervisionClock", "deployment_id", "detect_gpus", "detect_engine_packages", "engine_check", "engine_launch", "engine_marker",
    "engine_stop", "external_check", "external_reconcile", "launch_spec", "node_reconcile", "node_stop_all",
    "restart_delay", "stop_orphans", "this_node",
]
