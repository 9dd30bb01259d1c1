"""``runner doctor``: every installed backend says which of its layers work here, and the
Ray cluster when the policy dispatches."""

from __future__ import annotations

from dataclasses import dataclass

from runner.call.policy import Policy
from sandboxes import BackendConfigError, ChecksMachine, plugins


@dataclass(frozen=True)
class Layer:
    """One line of the report: ``backend`` names whose layer it is."""

    backend: str
    name: str
    ok: bool
    detail: str
    hint: str = ""


def check_layers(policy: Policy | None = None) -> list[Layer]:
    """Each installed backend, configured as the policy says (``{}`` without one), checked
    for real by the backend itself."""
    layers: list[Layer] = []
    for name in sorted(plugins.installed()):
        config = policy.model.sandbox.backends.get(name, {}) if policy is not None else {}
        try:
            backend = plugins.create(name, config)
        except BackendConfigError as exc:
            hint = "fix sandbox.backends in the policy"
            layers.append(Layer(name, "configuration", False, str(exc)[:160], hint))
            continue
        if not isinstance(backend, ChecksMachine):
            layers.append(Layer(name, "checks", True, "the backend has no checks of its own"))
            continue
        for check in backend.checks():
            layers.append(Layer(name, check.name, check.ok, check.detail, check.hint))
    if policy is not None and policy.model.dispatch is not None:
        from runner.dispatch.doctor import cluster_checks  # Ray: only when dispatch is configured

        for check in cluster_checks(policy.model.dispatch, policy.base_dir):
            layers.append(Layer("dispatch", check.name, check.ok, check.detail, check.hint))
    return layers
