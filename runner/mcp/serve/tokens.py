"""``runner serve tokens add``: a new bearer token, its digest written into the policy file.

The file is edited as ``runner.call.policy_edit`` edits it: comments kept, checked before it
replaces the file.
"""

from __future__ import annotations

from pathlib import Path

from ruamel.yaml.comments import CommentedMap, CommentedSeq

from runner.call.policy_edit import edit_policy
from runner.errors import ConfigError
from runner.mcp.serve.auth import new_token, token_digest


def add_token(policy_path: Path, name: str, role: str) -> str:
    """Add a token named ``name`` with ``role`` to the policy file; the token (shown once).

    Raises:
        ConfigError: the file cannot be read or written, or the result is not a valid
            policy (an unknown role, a name already taken).
    """
    token = new_token()

    def add(document: CommentedMap) -> None:
        serve = document.setdefault("serve", CommentedMap())
        if not isinstance(serve, CommentedMap):
            raise ConfigError(str(policy_path), "serve: must be a mapping")
        tokens = serve.setdefault("tokens", CommentedSeq())
        if not isinstance(tokens, CommentedSeq):
            raise ConfigError(str(policy_path), "serve.tokens: must be a list")
        entry = CommentedMap([("name", name), ("sha256", token_digest(token)), ("role", role)])
        entry.fa.set_flow_style()
        tokens.append(entry)

    edit_policy(policy_path, add, "the token was not added:")
    return token
