"""``runner images build``: the base image from Debian packages alone, then tool images.

No registry is needed: the base root filesystem comes from ``debootstrap`` using the
machine's own apt mirror, and goes in with ``docker import``. Each image is labelled
with a hash of its inputs, and skipped when that hash has not changed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BASE_IMAGE = "runner/base:latest"
SUITE = "bookworm"
PACKAGES = ("python3",)
HASH_LABEL = "io.runner.input-hash"
RECIPE_VERSION = "1"  # bump when the way the base is built changes
# Trimmed from the base root filesystem: nothing a tool runs needs them.
TRIM = (
    "var/cache/apt",
    "var/lib/apt/lists",
    "usr/share/doc",
    "usr/share/man",
    "usr/share/locale",
    "usr/share/info",
)

Progress = Callable[[str], None]
# Importing a root filesystem takes a while: the daemon's answer is waited for this long.
BUILD_TIMEOUT_S = 600


class ImageBuildError(Exception):
    """An image could not be built; the message says which and why."""


def apt_mirror() -> str:
    """The Debian mirror this machine's apt already uses (no other host is contacted)."""
    sources = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text()
        match = re.search(r"^URIs:\s*(\S+)", text, re.MULTILINE) or re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+" + SUITE + r"\s", text, re.MULTILINE
        )
        if match:
            return match.group(1)
    raise ImageBuildError("no Debian mirror found in the apt sources")


def _image_hash(client: Any, tag: str) -> str | None:
    from docker.errors import ImageNotFound

    try:
        labels = client.inspect_image(tag)["Config"].get("Labels") or {}
    except ImageNotFound:
        return None
    return labels.get(HASH_LABEL)


def base_hash(mirror: str) -> str:
    return hashlib.sha256(f"{RECIPE_VERSION}|{SUITE}|{','.join(PACKAGES)}|{mirror}".encode()).hexdigest()[:16]


def build_base(client: Any, progress: Progress) -> bool:
    """Build ``runner/base:latest`` unless it is up to date. Returns True when built."""
    mirror = apt_mirror()
    wanted = base_hash(mirror)
    if _image_hash(client, BASE_IMAGE) == wanted:
        progress(f"{BASE_IMAGE}: up to date")
        return False
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise ImageBuildError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="runner-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        progress(f"{BASE_IMAGE}: debootstrap {SUITE} ({', '.join(PACKAGES)})")
        done = subprocess.run(
            [debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), mirror],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = " ".join(done.stdout.splitlines()[-3:] + done.stderr.splitlines()[-3:])
            raise ImageBuildError(f"debootstrap failed: {tail[:300]}")
        for part in TRIM:
            shutil.rmtree(rootfs / part, ignore_errors=True)
            (rootfs / part).mkdir(parents=True, exist_ok=True)
        progress(f"{BASE_IMAGE}: docker import")
        archive = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(archive), "."], check=True)
        changes = [
            "ENV PATH=/usr/local/bin:/usr/bin:/bin",
            "ENV LANG=C.UTF-8",
            f"LABEL {HASH_LABEL}={wanted}",
            'CMD ["python3"]',
        ]
        with archive.open("rb") as data:
            client.import_image_from_data(
                data.read(), repository=BASE_IMAGE.split(":", maxsplit=1)[0], tag="latest", changes=changes
            )
    progress(f"{BASE_IMAGE}: built")
    return True


def context_hash(context: Path, base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(context)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_tool_images(client: Any, root: Path, progress: Progress) -> list[str]:
    """Build every ``root/NAME/Dockerfile`` as ``runner/NAME:latest``; returns what was built."""
    built = []
    base_id = client.inspect_image(BASE_IMAGE)["Id"]
    for context in sorted(p for p in root.iterdir() if (p / "Dockerfile").is_file()) if root.is_dir() else []:
        tag = f"runner/{context.name}:latest"
        wanted = context_hash(context, base_id)
        if _image_hash(client, tag) == wanted:
            progress(f"{tag}: up to date")
            continue
        progress(f"{tag}: building")
        log = []
        try:
            for chunk in client.build(
                path=str(context),
                tag=tag,
                pull=False,
                rm=True,
                forcerm=True,
                labels={HASH_LABEL: wanted},
                decode=True,
            ):
                if "error" in chunk:
                    raise ImageBuildError(f"{tag}: {' '.join(str(chunk['error']).split())[:300]}")
                log.append(chunk.get("stream", ""))
        except ImageBuildError:
            raise
        except Exception as exc:
            raise ImageBuildError(f"{tag}: {type(exc).__name__}: {exc}") from exc
        progress(f"{tag}: built")
        built.append(tag)
    return built


def build_images(contexts: Path, progress: Progress) -> None:
    """``runner images build``: the base image, then every tool image in ``contexts``
    (a folder of build contexts), on the local daemon.

    Raises:
        SandboxUnavailable: the daemon cannot be reached.
        ImageBuildError: an image could not be built.
    """
    from sandboxes.docker._client import api_client

    client = api_client()
    client.timeout = BUILD_TIMEOUT_S
    try:
        build_base(client, progress)
        build_tool_images(client, contexts, progress)
    finally:
        client.close()
