"""Dispatch: the sandboxes of chosen tools run on the nodes of a Ray cluster.

The guard stays on this host (policy, validation, breaker, audit, retries); each attempt
of a dispatched tool becomes one Ray task that needs one unit of the cluster's slots
resource, runs the attempt on its node through that node's own backend and returns the
``SandboxOutcome``. Ray is an optional extra (``pip install '<dist>[ray]'``) and is
imported only by ``cluster`` and ``sandbox``, and only when a dispatched call needs it.

    choice     which tools the policy's ``dispatch:`` section covers (the section itself:
               ``runner.config.dispatch``), and the sandbox of such a call
    bundle     a tool folder packed with its content hash; unpacked and checked on a node
    node       what runs inside the Ray task, on the node
    cluster    the connection to the cluster: token authentication checked first
    sandbox    the ``Sandbox`` the executor drives for a dispatched tool
    doctor     the ``ray cluster`` line of ``runner doctor``
"""

from runner.config.dispatch import DispatchModel
from runner.dispatch.choice import covers

__all__ = ["DispatchModel", "covers"]
