"""``runner serve tokens add``: a new bearer token, its digest written into the policy file.

The file is edited with ruamel.yaml's round trip, so its comments, key order and
quoting stay as they were; the edited document is validated as a policy before it
replaces the file (atomically, same permissions), so the edit never leaves a policy
that the runner would refuse.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

from runner.call.policy import Policy
from runner.errors import ConfigError
from runner.mcp.serve.auth import new_token, token_digest


def add_token(policy_path: Path, name: str, role: str) -> str:
    """Add a token named ``name`` with ``role`` to the policy file; the token (shown once).

    Raises:
        ConfigError: the file cannot be read or written, or the result is not a valid
            policy (an unknown role, a name already taken).
    """
    source = str(policy_path)
    yaml = YAML()  # round trip: comments and layout are kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # a digest is never folded onto the next line
    try:
        document = yaml.load(policy_path.read_text(encoding="utf-8"))
    except (OSError, YAMLError) as exc:
        raise ConfigError(source, f"cannot read the policy file: {exc}") from exc
    if not isinstance(document, CommentedMap):
        raise ConfigError(source, "a policy file must be a mapping")
    token = new_token()
    serve = document.setdefault("serve", CommentedMap())
    if not isinstance(serve, CommentedMap):
        raise ConfigError(source, "serve: must be a mapping")
    tokens = serve.setdefault("tokens", CommentedSeq())
    if not isinstance(tokens, CommentedSeq):
        raise ConfigError(source, "serve.tokens: must be a list")
    entry = CommentedMap([("name", name), ("sha256", token_digest(token)), ("role", role)])
    entry.fa.set_flow_style()
    tokens.append(entry)
    text = io.StringIO()
    yaml.dump(document, text)
    _replace_checked(policy_path, text.getvalue())
    return token


def _replace_checked(path: Path, text: str) -> None:
    """Write ``text`` beside ``path``, load it as the runner would, then put it in place."""
    try:
        mode = path.stat().st_mode & 0o7777
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".yaml")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot write beside the policy file: {exc.strerror}") from exc
    written = Path(temporary)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        try:
            Policy.load(written)
        except ConfigError as exc:
            raise ConfigError(str(path), f"the token was not added: {exc.problem}") from None
        written.chmod(mode)
        written.replace(path)
    except OSError as exc:
        raise ConfigError(str(path), f"cannot write the policy file: {exc.strerror}") from exc
    finally:
        written.unlink(missing_ok=True)
