"""read_file: the text of one file of the workspace (granted read)."""

from runner_tool import ToolError, run, workspace_path


def main(params, context):
    relative = params["path"]
    target = workspace_path(relative)
    try:
        content = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ToolError(f"no such file: {relative}", code="NOT_FOUND") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolError(f"cannot read {relative}: {type(exc).__name__}", code="UNREADABLE") from None
    return {"path": relative, "content": content}


if __name__ == "__main__":
    run(main)
