"""The runner's state folder (``state_dir``) and the root of calls' scratch folders in it
(``<state_dir>/scratch``).

The folders the runner makes for its state must let the sandbox's uid pass, whatever the
umask. And it makes folders in ``scratch``, chowns them (as root) and removes them by path,
in every mode that uses it (fork mode's templates, the rootless and degraded cold paths,
the start-up sweep of what dead runners left, `runner doctor`): so it must be made
passable whatever the umask, and a link there, or a state folder someone else may change,
is refused rather than followed."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import ToolBench
from support.state_folders import passable_folder

from sandboxes._owners import remove_folders
from sandboxes._state_folder import state_folder
from sandboxes.base import SandboxUnavailable
from sandboxes.runtime_folder import runtime_folder
from sandboxes.subprocess import SubprocessConfig, SubprocessSandbox
from sandboxes.subprocess._cgroup import CgroupFactory, CgroupUnavailable

ECHO_TMP = (
    "import json, os, sys\njson.load(sys.stdin)\nprint(json.dumps(os.path.realpath(os.environ['TMPDIR'])))\n"
)


def _state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)
    return state


# Above the most the kernel's pid_max can be (2**22): a runner of that pid never lived.
DEAD_PID = 2**22 + 1


def test_the_scratch_root_is_made_passable_and_must_be_the_runners_own_and_no_link(tmp_path: Path) -> None:
    state = _state(tmp_path)
    backend = SubprocessSandbox(SubprocessConfig(state_dir=state))
    backend.set_up()
    previous = os.umask(0o077)
    try:
        assert backend.own_scratch_root() == state / "scratch"
    finally:
        os.umask(previous)
    assert stat.S_IMODE((state / "scratch").lstat().st_mode) == 0o711  # passable, whatever the umask
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (state / "scratch").rmdir()
    (state / "scratch").symlink_to(elsewhere)
    with pytest.raises(SandboxUnavailable, match="scratch"):
        backend.own_scratch_root()
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o700  # not followed
    (state / "scratch").unlink()
    state.chmod(0o777)
    with pytest.raises(SandboxUnavailable, match="others may write"):
        backend.own_scratch_root()
    assert not (state / "scratch").exists()
    if os.geteuid() == 0:
        state.chmod(0o755)
        (state / "scratch").mkdir(mode=0o711)
        os.chown(state / "scratch", 65534, 65534)
        with pytest.raises(SandboxUnavailable, match="not the runner's own"):
            backend.own_scratch_root()


def test_the_start_up_sweep_never_lists_the_scratch_root_through_a_link(tmp_path: Path) -> None:
    state = _state(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    left = elsewhere / f"{DEAD_PID}-1"  # named as a dead runner's scratch folder
    left.mkdir(parents=True)
    (state / "scratch").symlink_to(elsewhere)
    backend = SubprocessSandbox(SubprocessConfig(state_dir=state))
    backend.set_up()
    assert left.is_dir()  # someone else's folder, reached through a link: not swept
    (state / "scratch").unlink()
    (state / "scratch").mkdir(mode=0o711)
    ours = state / "scratch" / left.name
    ours.mkdir()
    SubprocessSandbox(SubprocessConfig(state_dir=state)).set_up()
    assert not ours.exists()  # in the runner's own folder, a dead runner's is swept


@pytest.mark.parametrize(
    "mode",
    [
        "degraded",
        pytest.param(
            "rootless",
            marks=pytest.mark.skipif(os.geteuid() == 0, reason="without root: scripts/test-rootless.sh"),
        ),
    ],
)
def test_a_call_is_refused_rather_than_given_a_scratch_folder_through_a_link(
    bench: ToolBench, tmp_path: Path, request: pytest.FixtureRequest, mode: str
) -> None:
    # The call's folder is made in the scratch root by path, and chowned to the tool's uid
    # as root in degraded mode: through a link, that would be a folder of the tool's
    # anywhere the link's maker chose.
    state = _state(passable_folder(tmp_path, request))
    elsewhere = state.parent / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    bench.tool("echo_tmp", ECHO_TMP)
    backend: dict[str, object] = {"state_dir": str(state)}
    if mode == "degraded":
        backend |= {"allow_degraded": True, "bwrap": "/nonexistent"}
    bench.policy["sandbox"] = {"backends": {"subprocess": backend}}
    runner = bench.runner()
    working = runner.handle({"toolName": "echo_tmp"})  # the scratch root made as it should be
    assert working["success"], working["error"]
    (state / "scratch").rename(state / "aside")  # its call's folder may not be removed yet
    (state / "scratch").symlink_to(elsewhere)
    answer = runner.handle({"toolName": "echo_tmp"})
    assert not answer["success"], f"ran with its scratch in {answer['result']}"
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "cannot use the scratch folder" in answer["error"]["message"]
    assert list(elsewhere.iterdir()) == []


def test_the_folders_made_for_a_configured_state_folder_let_the_sandbox_pass_whatever_the_umask(
    bench: ToolBench, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # systemd's unit runs the runner under UMask=0077: the missing folders above a
    # configured state folder came out 0700, and as root every call failed (bubblewrap,
    # as the sandbox's uid, could not reach the files bound from the state folder).
    home = passable_folder(tmp_path, request)
    state = home / "made" / "above" / "state"
    bench.tool("echo_tmp", ECHO_TMP)
    bench.policy["sandbox"] = {"backends": {"subprocess": {"state_dir": str(state)}}}
    previous = os.umask(0o077)
    try:
        answer = bench.runner().handle({"toolName": "echo_tmp"})
    finally:
        os.umask(previous)
    assert answer["success"], answer["error"]
    for folder in (home / "made", home / "made" / "above", state):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder


def test_the_sweeps_remove_nothing_in_a_state_folder_someone_else_may_change(tmp_path: Path) -> None:
    # Checked, then listed by path, a scratch folder could be swapped for a link in between
    # by whoever may write in the state folder: that someone must be the runner alone.
    state = _state(tmp_path)
    left = state / "scratch" / f"{DEAD_PID}-1"
    left.mkdir(parents=True)
    (state / "scratch").chmod(0o711)
    state.chmod(0o777)
    remove_folders(state / "scratch", lambda name: True)
    assert left.is_dir()
    state.chmod(0o755)
    remove_folders(state / "scratch", lambda name: True)
    assert not left.exists()


def _refused(backend: SubprocessSandbox, reason: str) -> None:
    """Set up without a traceback, nothing made in the state folder, every sandbox and
    every use of its scratch refused with ``reason``, and ``runner doctor`` saying why."""
    backend.set_up()
    with pytest.raises(SandboxUnavailable, match=reason):
        backend.own_scratch_root()
    (state_check,) = [check for check in backend.checks() if check.name == "state folder"]
    assert not state_check.ok and re.search(reason, state_check.detail), state_check


def test_a_state_folder_someone_else_could_swap_is_refused_before_anything_is_written(
    bench: ToolBench, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could swap the state folder in it for another
    _refused(SubprocessSandbox(SubprocessConfig(state_dir=shared / "state")), f"may write in {shared}")
    assert list(shared.iterdir()) == []  # not made, nor /etc files written through it
    bench.tool("echo_tmp", ECHO_TMP)
    bench.policy["sandbox"] = {"backends": {"subprocess": {"state_dir": str(shared / "state")}}}
    answer = bench.runner().handle({"toolName": "echo_tmp"})
    assert not answer["success"]
    assert answer["error"]["details"]["reason"] == "sandbox_unavailable"
    assert "cannot use the state folder" in answer["error"]["message"]
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")  # one command of another local user's, in /tmp
    _refused(
        SubprocessSandbox(SubprocessConfig(state_dir=loop / "state")), "Too many levels of symbolic links"
    )


def test_the_state_folder_is_resolved_once_through_links_only_root_or_the_runner_made(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # as /tmp: only the owner of what is in it may swap that
    (tmp_path / "link").symlink_to(sticky / "state")
    linked = SubprocessSandbox(SubprocessConfig(state_dir=tmp_path / "link"))
    linked.set_up()
    assert linked.state_dir == sticky / "state"  # followed once, when it started
    assert linked.own_scratch_root() == sticky / "state" / "scratch"
    if os.geteuid() != 0:
        return  # only root can make a link someone else's
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "kept").write_text("as it was")
    # Planted where the state folder was to be, or on the way inside a link's target.
    (sticky / "planted").symlink_to(victim)
    (sticky / "hop").symlink_to(tmp_path)
    (tmp_path / "through").symlink_to(sticky / "hop" / "victim")
    for planted in (sticky / "planted", sticky / "hop"):
        os.chown(planted, 65534, 65534, follow_symlinks=False)
    for configured in (sticky / "planted", tmp_path / "through"):
        backend = SubprocessSandbox(SubprocessConfig(state_dir=configured))
        backend.set_up()
        assert stat.S_IMODE(victim.stat().st_mode) == 0o700, configured  # nothing written through it
        assert [p.name for p in victim.iterdir()] == ["kept"], configured
        _refused(backend, "link someone other than root")


def test_a_state_folder_that_cannot_be_written_in_is_refused_not_raised(tmp_path: Path) -> None:
    # A file where a folder goes (or a read-only or full file system): set-up raised, was
    # tried again by every call, and runner doctor printed a traceback.
    state = _state(tmp_path)
    (state / "etc").write_text("not a folder")
    _refused(SubprocessSandbox(SubprocessConfig(state_dir=state)), "cannot write in it")


def test_the_root_folder_is_never_a_state_folder() -> None:
    # Its etc/ is the host's /etc: set-up would write the sandboxes' passwd over the host's.
    folder, problem = state_folder(Path("/"))
    assert (folder, problem) == (Path("/"), "the state folder cannot be /")


def test_the_runtime_folder_is_the_users_own_real_folder_or_none(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    own.chmod(0o700)  # whatever the umask (002 gives 0775: others may write)
    if os.geteuid() == 0:
        uid, others = 4242, tmp_path / "roots"  # a user of no other folder here
        others.mkdir()
        os.chown(own, uid, -1)
    else:
        uid, others = os.geteuid(), Path("/run")
    link = tmp_path / "link"
    link.symlink_to(own)
    shared = tmp_path / "shared"  # the user's, but others may write in it
    shared.mkdir()
    shared.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(shared, uid, -1)
    assert runtime_folder(uid, {"XDG_RUNTIME_DIR": str(own)}) == own
    # Someone else's (root's, inherited through su without -), a link, a relative value
    # or none: the user's /run/user/UID where there is one, else nothing.
    expected = runtime_folder(uid, {})
    assert expected in (None, Path(f"/run/user/{uid}"))
    for inherited in (str(others), str(link), str(shared), "own", ""):
        assert runtime_folder(uid, {"XDG_RUNTIME_DIR": inherited}) == expected, inherited


@pytest.mark.skipif(os.geteuid() == 0, reason="without root: scripts/test-rootless.sh")
def test_a_runtime_folder_inherited_from_another_user_is_not_the_default_state_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # su without -: XDG_RUNTIME_DIR still names root's folder, where this user cannot
    # make one. Every call was refused ("cannot use the state folder").
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the last resort: $TMPDIR's
    uid = os.geteuid()
    runtime = runtime_folder(uid, {})
    expected = runtime / "runner" if runtime is not None else tmp_path / f"runner-{uid}"
    backend = SubprocessSandbox(SubprocessConfig())
    backend.set_up()
    assert backend.state_problem is None, backend.state_problem
    assert backend.state_dir == expected
    assert backend.own_scratch_root().is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root: without root a call has no cgroup of its own here")
def test_a_call_degraded_by_its_cgroup_gets_its_folder_in_the_checked_scratch_root(
    bench: ToolBench, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the cgroup's refusal, as the call is prepared, makes it degraded: its scratch
    # root was then never checked, and the call failed on an internal error.
    def refused(*_: object) -> None:
        raise CgroupUnavailable("no cgroup for this test")

    monkeypatch.setattr(CgroupFactory, "create", refused)
    state = _state(passable_folder(tmp_path, request))
    bench.tool("echo_tmp", ECHO_TMP)
    bench.policy["sandbox"] = {"backends": {"subprocess": {"state_dir": str(state), "allow_degraded": True}}}
    answer = bench.runner().handle({"toolName": "echo_tmp"})
    assert answer["success"], answer["error"]
    assert answer["metadata"].get("degraded") is True
    assert Path(answer["result"]).parent == state / "scratch"
