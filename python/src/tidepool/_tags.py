"""Allocation tags through the C ABI: names to ids, and the thread-local tag scope."""

from __future__ import annotations

from . import _lib

OPTIMIZER_STATE = 4  # TIDEPOOL_TAG_OPTIMIZER_STATE in allocator/c_api.h
WORKSPACE = 5  # TIDEPOOL_TAG_WORKSPACE
TAG_MAX = 64  # TIDEPOOL_TAG_MAX


def tag_id(tag: str | int) -> int:
    """The id of a tag name ("optimizer_state", or any user name; created on first use),
    or an id, which must name a tag (region() would otherwise make a MemPool for it before
    the push refused it)."""
    if isinstance(tag, int):
        if not _fits_c_int(tag):  # ctypes would pass 2**32 + 4 on as 4
            raise ValueError(f"tidepool: {tag} is not a tag id")
        if tag_name(tag) is None:
            raise ValueError(f"tidepool: no tag has the id {tag}")
        return tag
    _check_name(tag)
    fn = _lib.function("tidepool_tag_id", "allocation tags")
    return _lib.check(fn(tag.encode("utf-8")), f"tag {tag!r}")


def _check_name(tag) -> None:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tidepool: a tag is a non-empty name or an id, not {tag!r}")
    # ctypes passes a name cut at a NUL byte: another tag's name (libtidepool refuses it).
    if "\0" in tag:
        raise ValueError(f"tidepool: tag name holds a NUL byte: {tag!r}")


def existing_tag_id(tag: str | int) -> int | None:
    """The id of a tag that exists (built in, or made by region() / tag_id()), for
    evict and prefetch, which only act on what is there: a name not made yet has no
    allocations, so None (and, unlike tag_id, it is not created: the table holds only
    TIDEPOOL_TAG_MAX tags, and a lookup must not use one up). An id that names no tag
    is a ValueError: the C ABI would take it and silently move nothing."""
    if isinstance(tag, int):
        if tag_name(tag) is None:
            raise ValueError(f"tidepool: no tag has the id {tag}")
        return tag
    _check_name(tag)
    return next((i for i in range(TAG_MAX) if tag_name(i) == tag), None)


def _fits_c_int(value: int) -> bool:
    return not isinstance(value, bool) and -2**31 <= value < 2**31


def tag_name(tag: int) -> str | None:
    if not _fits_c_int(tag):  # ctypes would pass 2**32 + 4 on as 4
        return None
    fn = _lib.function("tidepool_tag_name", "allocation tags")
    name = fn(tag)
    return name.decode("utf-8") if name else None


def push(tag: int) -> None:
    _lib.check(_lib.function("tidepool_tag_push", "allocation tags")(tag), f"tag push {tag}")


def pop() -> None:
    _lib.check(_lib.function("tidepool_tag_pop", "allocation tags")(), "tag pop")


def current() -> int:
    return _lib.function("tidepool_tag_current", "allocation tags")()
