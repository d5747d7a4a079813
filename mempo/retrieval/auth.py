"""Where the retrieval service's bearer token comes from: the environment or a file, never argv.

    MEMPO_RETRIEVER_TOKEN=...            # the token itself (a Kubernetes secret as env)
    MEMPO_RETRIEVER_TOKEN_FILE=/path     # or a file holding it (a mounted secret)

The server (`mempo serve retriever`) and every client (`HttpRetriever`, hence the trainers,
the evaluation and the verl tool) call `read_token`, so setting one variable switches auth on
for all of them. A token on the command line would show in `ps` to every user of the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from mempo.errors import ConfigError

TOKEN_ENV = "MEMPO_RETRIEVER_TOKEN"
TOKEN_FILE_ENV = "MEMPO_RETRIEVER_TOKEN_FILE"


def read_token_file(path: str | Path) -> str:
    """The token in `path` (surrounding whitespace removed). ConfigError if unreadable/empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"cannot read the retriever token file: {e.strerror}", path=path) from None
    if not token:
        raise ConfigError("the retriever token file is empty", path=path)
    if any(c.isspace() for c in token):
        raise ConfigError("the retriever token must be one line without spaces", path=path)
    return token


def read_token(token: str | None = None, token_file: str | Path | None = None) -> str | None:
    """The bearer token to use: `token`, else the file `token_file`, else $MEMPO_RETRIEVER_TOKEN,
    else the file named by $MEMPO_RETRIEVER_TOKEN_FILE; None when none of them is set."""
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    env_file = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if env_file:
        return read_token_file(env_file)
    return None
