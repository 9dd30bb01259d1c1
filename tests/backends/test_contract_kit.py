"""``sandboxes.testing`` against both backends, and proof that each of its checks can fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from docker import APIClient
from support.naive_backend import NaiveSandbox

from sandboxes import Sandbox, plugins
from sandboxes.testing import CONTRACT, Harness
from sandboxes.testing import Check as ContractCheck

IDS = [check.__name__ for check in CONTRACT]


@pytest.fixture(scope="module")
def subprocess_backend() -> Sandbox:
    return plugins.create("subprocess", {})


@pytest.mark.parametrize("check", CONTRACT, ids=IDS)
def test_the_subprocess_backend_keeps_the_contract(
    check: ContractCheck, subprocess_backend: Sandbox, tmp_path: Path
) -> None:
    harness = Harness(
        make=lambda: subprocess_backend,
        workdir=tmp_path,
        unavailable=lambda: plugins.create("subprocess", {"bwrap": "/nonexistent/bwrap"}),
    )
    asyncio.run(check(harness))


@pytest.mark.docker
@pytest.mark.parametrize("check", CONTRACT, ids=IDS)
def test_the_docker_backend_keeps_the_contract(
    check: ContractCheck, docker_client: APIClient, tmp_path: Path
) -> None:
    backend = plugins.create("docker", {})
    harness = Harness(
        make=lambda: backend,
        workdir=tmp_path,
        image="runner/base:latest",
        unavailable=lambda: plugins.create("docker", {"runtime": "no-such-runtime"}),
    )
    asyncio.run(check(harness))


# For each check, a backend that breaks what it checks (the naive one breaks the limits).
MUTANTS = {
    "check_success_returns_stdout": "wrong_stdout",
    "check_exit_status_is_reported": "exit_zero",
    "check_stderr_is_kept_as_a_tail": "no_stderr",
    "check_close_twice_is_safe": "close_twice_raises",
    "check_prepare_then_close_without_run_leaves_nothing": "leaky_prepare",
}


@pytest.mark.parametrize("check", CONTRACT, ids=IDS)
def test_every_check_fails_against_a_backend_that_breaks_it(check: ContractCheck, tmp_path: Path) -> None:
    flaw = MUTANTS.get(check.__name__, "")
    harness = Harness(make=lambda: NaiveSandbox(flaw), workdir=tmp_path, unavailable=NaiveSandbox)
    with pytest.raises(AssertionError):
        asyncio.run(check(harness))
    _kill_what_the_mutant_left(tmp_path)


def _kill_what_the_mutant_left(workdir: Path) -> None:
    from support.naive_backend import LEAKED, kill_leftovers

    for folder in workdir.iterdir():
        kill_leftovers(folder.name)
    while LEAKED:
        leaked = LEAKED.pop()
        leaked.kill()
        leaked.wait()


def test_gone_is_not_fooled_by_one_look_that_misses_a_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process fresh from its exec shows an empty environment for a moment: one look
    # that misses it must not count as the process being gone.
    monkeypatch.setattr("sandboxes.testing._harness.GONE_WITHIN_S", 0.3)
    looks = iter([False])
    harness = Harness(make=NaiveSandbox, workdir=tmp_path, alive=lambda _: next(looks, True))
    assert not asyncio.run(harness.gone("contract-x"))
    always_absent = Harness(make=NaiveSandbox, workdir=tmp_path, alive=lambda _: False)
    assert asyncio.run(always_absent.gone("contract-x"))
