"""delete_file: remove one file from the workspace (granted write)."""

from runner_tool import ToolError, run, workspace_path


def main(params, context):
    relative = params["path"]
    target = workspace_path(relative)
    if not target.is_file():
        raise ToolError(f"no such file: {relative}", code="NOT_FOUND")
    try:
        target.unlink()
    except OSError as exc:
        raise ToolError(f"cannot delete {relative}: {type(exc).__name__}", code="UNDELETABLE") from None
    return {"path": relative, "deleted": True}


if __name__ == "__main__":
    run(main)
