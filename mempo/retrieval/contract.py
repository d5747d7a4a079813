"""What the retrieval service accepts: its limits, and validation of /retrieve and /access bodies.

    from mempo.retrieval.contract import ServiceLimits, parse_body, parse_retrieve
    queries, topk, scores = parse_retrieve(parse_body(raw_bytes, ServiceLimits()), ServiceLimits())

Every check raises `BadRequest(status, message, reason)`: 413 for a body over
`max_body_bytes`, 400 for one that is not UTF-8 JSON (or nests too deeply), 422 for a wrong
field (missing, wrong type, empty, too many items, too long, `topk` out of range). The message
names the field and item (`'queries[3]' is empty`); `reason` is the metric label.
`mempo.retrieval.server` turns it into the HTTP answer.
"""

from __future__ import annotations

import json
from typing import Any

from mempo.config import ServiceLimitParams


class ServiceLimits(ServiceLimitParams):
    """Request limits and scheduling knobs (params.yaml `serve:`, `ServiceLimitParams`) plus the
    optional bearer token, which comes from the environment or a file, never from params."""

    token: str | None = None


class BadRequest(Exception):
    """A client error: HTTP `status` with a one-line message."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


def _loads(raw: bytes) -> Any:
    """Parse JSON; orjson when installed (faster, and it stops at 1024 levels of nesting)."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - orjson is in requirements.lock
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e) or "recursion" in str(e):
            raise RecursionError(str(e)) from None
        raise json.JSONDecodeError(str(e).split(":", 1)[0], e.doc, e.pos) from None


def parse_body(raw: bytes, limits: ServiceLimits) -> dict[str, Any]:
    """The JSON object in a request body. Raises BadRequest (413, 400 or 422)."""
    if len(raw) > limits.max_body_bytes:
        raise BadRequest(413, f"body is {len(raw)} bytes, over the {limits.max_body_bytes}-byte limit",
                         "body_too_large")
    if not raw.strip():
        raise BadRequest(400, "empty body; send a JSON object", "empty_body")
    try:
        obj = _loads(raw)
    except UnicodeDecodeError:
        raise BadRequest(400, "body is not valid UTF-8", "bad_encoding") from None
    except RecursionError:
        # A small body of nested brackets would otherwise blow the parser's stack.
        raise BadRequest(400, "body nests too deeply; send a flat JSON object", "too_deep") from None
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"body is not valid JSON: {e.msg} at character {e.pos}",
                         "bad_json") from None
    if not isinstance(obj, dict):
        raise BadRequest(422, f"body must be a JSON object, got {type(obj).__name__}", "not_object")
    return obj


def _string_list(obj: dict[str, Any], key: str, max_items: int, max_chars: int | None) -> list[str]:
    value = obj[key]
    if not isinstance(value, list):
        raise BadRequest(422, f"'{key}' must be a list of strings, got {type(value).__name__}",
                         f"{key}_not_list")
    if not value:
        raise BadRequest(422, f"'{key}' must not be empty", f"{key}_empty")
    if len(value) > max_items:
        raise BadRequest(422, f"'{key}' has {len(value)} items, over the limit of {max_items} "
                         "per request; split it", f"too_many_{key}")
    for i, q in enumerate(value):
        if not isinstance(q, str):
            raise BadRequest(422, f"'{key}[{i}]' must be a string, got {type(q).__name__}",
                             f"{key}_item_not_string")
        if not q.strip():
            raise BadRequest(422, f"'{key}[{i}]' is empty", f"{key}_item_empty")
        if max_chars is not None and len(q) > max_chars:
            raise BadRequest(422, f"'{key}[{i}]' has {len(q)} characters, over the limit of "
                             f"{max_chars}", f"{key}_item_too_long")
    return value


def parse_retrieve(obj: dict[str, Any], limits: ServiceLimits) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body -> (queries, topk, return_scores). Raises BadRequest."""
    if "queries" not in obj:
        raise BadRequest(422, "missing required field 'queries' (a list of strings)", "missing_queries")
    queries = _string_list(obj, "queries", limits.max_queries_per_request, limits.max_query_chars)
    topk = obj.get("topk")
    if topk is None:
        topk = limits.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise BadRequest(422, f"'topk' must be an integer, got {type(topk).__name__}", "topk_not_int")
    if not 1 <= topk <= limits.max_topk:
        raise BadRequest(422, f"'topk' must be between 1 and {limits.max_topk}, got {topk}",
                         "topk_out_of_range")
    scores = obj.get("return_scores", False)
    if scores is None:
        scores = False
    if not isinstance(scores, bool):
        raise BadRequest(422, f"'return_scores' must be true or false, got {type(scores).__name__}",
                         "return_scores_not_bool")
    return queries, topk, scores


def parse_access(obj: dict[str, Any], limits: ServiceLimits) -> tuple[str, list[str]]:
    """Validate an /access body -> ("ids" | "titles", keys). Raises BadRequest."""
    given = [k for k in ("ids", "titles") if obj.get(k) is not None]
    if len(given) != 1:
        raise BadRequest(422, "give exactly one of 'ids' or 'titles' (a list of strings)",
                         "access_keys")
    key = given[0]
    return key, _string_list(obj, key, limits.max_access_items, limits.max_query_chars)
