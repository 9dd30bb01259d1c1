"""The call path: the guard (tool, params, secrets, policy, breaker), the plan, the attempts,
warm pools, backends, and the call's answer."""
