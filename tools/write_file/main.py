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


params = json.load(sys.stdin)["params"]
target = confined(params["path"])
data = params["content"].encode("utf-8")
try:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
except OSError as exc:
    fail(f"cannot write {params['path']}: {type(exc).__name__}")
json.dump({"path": params["path"], "bytes": len(data)}, sys.stdout)
