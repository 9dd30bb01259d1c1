"""write_file: write one text file into the workspace (granted write)."""

from runner_tool import ToolError, run, workspace_path


def main(params, context):
    relative = params["path"]
    target = workspace_path(relative)
    data = params["content"].encode("utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    except OSError as exc:
        raise ToolError(f"cannot write {relative}: {type(exc).__name__}", code="UNWRITABLE") from None
    return {"path": relative, "bytes": len(data)}


if __name__ == "__main__":
    run(main)
