"""The call path: plan, attempts, breaker, warm pools, backends, and the call's answer."""
