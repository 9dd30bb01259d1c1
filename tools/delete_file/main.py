import json
import os
import sys
from pathlib import Path


def fail(message):
    json.dump({"error": {"message": message}}, sys.stdout)
    sys.exit(1)


def confined(relative):
    """The workspace path for ``relative``; anything that leaves the workspace is refused."""
    root = Path(os.environ["WORKSPACE"]).resolve()
    target = (root / relative).resolve()
    if Path(relative).is_absolute() or not target.is_relative_to(root) or target == root:
        fail(f"path {relative!r} is outside the workspace")
    return target


relative = json.load(sys.stdin)["params"]["path"]
target = confined(relative)
if not target.is_file():
    fail(f"no such file: {relative}")
try:
    target.unlink()
except OSError as exc:
    fail(f"cannot delete {relative}: {type(exc).__name__}")
json.dump({"path": relative, "deleted": True}, sys.stdout)
