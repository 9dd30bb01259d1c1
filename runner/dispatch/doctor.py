"""``runner doctor``'s view of the cluster a policy dispatches to: nodes and free slots."""

from __future__ import annotations

from pathlib import Path

from runner.config.dispatch import DispatchModel
from sandboxes import Check, SandboxUnavailable


def cluster_checks(model: DispatchModel, base_dir: Path) -> list[Check]:
    """The line ``ray cluster`` (joined with token authentication, nodes, free slots), then
    one line per node offering slots. Joins the cluster (a few seconds at most)."""
    from runner.dispatch.cluster import join, node_slots

    try:
        join(model, base_dir)
    except SandboxUnavailable as exc:
        hint = "see docs/dispatch.md: the cluster must run with RAY_AUTH_MODE=token"
        return [Check("ray cluster", False, exc.message, hint)]
    nodes = node_slots(model.slots_resource)
    total = sum(node.total for node in nodes)
    free = sum(node.free for node in nodes)
    summary = (
        f"{model.address}: token authentication on, {len(nodes)} node(s) offering "
        f"{model.slots_resource}, {free:g} of {total:g} slots free"
    )
    hint = f"start nodes with --resources '{{\"{model.slots_resource}\": N}}'"
    checks = [Check("ray cluster", bool(nodes), summary, "" if nodes else hint)]
    for node in nodes:
        detail = f"{node.address}: {node.free:g} of {node.total:g} slots free"
        checks.append(Check(f"node {node.node_id[:12]}", True, detail))
    return checks
