"""Replacing attributes of torch (functions, methods) so that they can be put back.

Global mode replaces a few of torch's functions whose pluggable-allocator versions raise
or do nothing (_record_stream.py, _torch_memory.py). Each replacement keeps the original
as its __wrapped__ and in a Patches object, whose remove() restores every one of them.
"""

from __future__ import annotations


class Patches:
    def __init__(self):
        self._originals: list[tuple[object, str, object]] = []

    def replace(self, owner, name: str, fn) -> None:
        """owner.name = fn, remembering what was there (fn.__wrapped__ names it too)."""
        original = getattr(owner, name)
        fn.__wrapped__ = original
        fn.__doc__ = fn.__doc__ or original.__doc__
        self._originals.append((owner, name, original))
        setattr(owner, name, fn)

    def remove(self) -> None:
        """Puts every original back (latest first); a second call does nothing."""
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)
