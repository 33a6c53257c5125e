"""Allocation tags through the C ABI: names to ids, and the thread-local tag scope."""

from __future__ import annotations

from . import _lib

OPTIMIZER_STATE = 4  # TIDEPOOL_TAG_OPTIMIZER_STATE in allocator/c_api.h
WORKSPACE = 5  # TIDEPOOL_TAG_WORKSPACE


def tag_id(tag: str | int) -> int:
    """The id of a tag name ("optimizer_state", or any user name; created on first use)."""
    if isinstance(tag, int):
        return tag
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tidepool: a tag is a non-empty name or an id, not {tag!r}")
    fn = _lib.function("tidepool_tag_id", "allocation tags")
    return _lib.check(fn(tag.encode("utf-8")), f"tag {tag!r}")


def tag_name(tag: int) -> str | None:
    fn = _lib.function("tidepool_tag_name", "allocation tags")
    name = fn(tag)
    return name.decode("utf-8") if name else None


def push(tag: int) -> None:
    _lib.check(_lib.function("tidepool_tag_push", "allocation tags")(tag), f"tag push {tag}")


def pop() -> None:
    _lib.check(_lib.function("tidepool_tag_pop", "allocation tags")(), "tag pop")


def current() -> int:
    return _lib.function("tidepool_tag_current", "allocation tags")()
