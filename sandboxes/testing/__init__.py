"""The contract every backend keeps, as checks a backend's own tests can run; and a fake
backend for tests of what sits above a sandbox (``sandboxes.testing.fake``).

Each check is an ``async`` function taking a ``Harness`` and raising ``AssertionError``
when the backend breaks a promise of the interface (``sandboxes.base``). They drive the
backend directly (``prepare`` -> ``run`` -> ``close``), with real tools written on the fly,
so they hold for any backend, ours or a plugin's::

    import asyncio, pytest
    from sandboxes.testing import CONTRACT, Harness
    from my_backend import create

    @pytest.mark.parametrize("check", CONTRACT, ids=lambda check: check.__name__)
    def test_my_backend_keeps_the_contract(check, tmp_path):
        asyncio.run(check(Harness(make=lambda: create({}), workdir=tmp_path)))

The tools are Python programs (``python3`` on the sandbox's PATH). ``Harness.alive`` tells
whether anything started for a request is still running; the default looks through this
host's ``/proc`` for the ``REQUEST_ID`` the harness puts in each tool's environment.
``DIALOGUE_CONTRACT`` holds the checks of a backend whose sandboxes hold a ``Dialogue``.

``FakeBackend`` runs nothing: each call is answered by a function of yours, so that an
agent or a tool's callers can be tested with ``Runner`` and no sandbox at all.
"""

from __future__ import annotations

from sandboxes.testing._contract import (
    CONTRACT,
    check_a_cancelled_run_leaves_nothing,
    check_a_program_that_cannot_start_is_not_executable,
    check_a_timeout_kills_the_whole_tree,
    check_an_unavailable_backend_raises_from_prepare,
    check_close_twice_is_safe,
    check_cpu_time_past_the_budget_is_a_cpu_limit,
    check_exit_status_is_reported,
    check_forks_past_the_limit_are_a_pids_limit,
    check_memory_past_the_limit_is_a_memory_limit,
    check_output_past_the_cap_is_an_output_limit,
    check_prepare_then_close_without_run_leaves_nothing,
    check_secrets_reach_the_tool_as_environment_and_stdin_stays_the_payload,
    check_stderr_is_kept_as_a_tail,
    check_success_returns_stdout,
    check_the_tool_side_helper_imports_and_is_read_only,
)
from sandboxes.testing._dialogue import (
    DIALOGUE_CONTRACT,
    LINE_ECHO,
    Drain,
    Lines,
    check_a_cancelled_dialogue_leaves_nothing,
    check_a_dialogue_flooded_past_the_cap_is_an_output_limit,
    check_a_dialogue_hears_each_answer_and_its_end_kills_the_tool,
    check_a_dialogue_keeps_the_stderr_tail,
    check_a_dialogue_with_a_hanging_tool_times_out_from_the_start_of_talk,
    check_a_dialogue_with_a_program_that_cannot_start_is_not_executable,
    check_a_tool_that_exits_mid_dialogue_is_an_exit_code_even_for_zero,
)
from sandboxes.testing._harness import GONE_WITHIN_S, Check, Harness, processes_alive, processes_with_env
from sandboxes.testing.fake import Crash, FakeBackend, Timeout, ToolCall, ToolError

__all__ = [
    "CONTRACT",
    "DIALOGUE_CONTRACT",
    "GONE_WITHIN_S",
    "LINE_ECHO",
    "Check",
    "Crash",
    "Drain",
    "FakeBackend",
    "Harness",
    "Lines",
    "Timeout",
    "ToolCall",
    "ToolError",
    "check_a_cancelled_dialogue_leaves_nothing",
    "check_a_cancelled_run_leaves_nothing",
    "check_a_dialogue_flooded_past_the_cap_is_an_output_limit",
    "check_a_dialogue_hears_each_answer_and_its_end_kills_the_tool",
    "check_a_dialogue_keeps_the_stderr_tail",
    "check_a_dialogue_with_a_hanging_tool_times_out_from_the_start_of_talk",
    "check_a_dialogue_with_a_program_that_cannot_start_is_not_executable",
    "check_a_program_that_cannot_start_is_not_executable",
    "check_a_timeout_kills_the_whole_tree",
    "check_a_tool_that_exits_mid_dialogue_is_an_exit_code_even_for_zero",
    "check_an_unavailable_backend_raises_from_prepare",
    "check_close_twice_is_safe",
    "check_cpu_time_past_the_budget_is_a_cpu_limit",
    "check_exit_status_is_reported",
    "check_forks_past_the_limit_are_a_pids_limit",
    "check_memory_past_the_limit_is_a_memory_limit",
    "check_output_past_the_cap_is_an_output_limit",
    "check_prepare_then_close_without_run_leaves_nothing",
    "check_secrets_reach_the_tool_as_environment_and_stdin_stays_the_payload",
    "check_stderr_is_kept_as_a_tail",
    "check_success_returns_stdout",
    "check_the_tool_side_helper_imports_and_is_read_only",
    "processes_alive",
    "processes_with_env",
]
