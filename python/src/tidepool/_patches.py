"""Replacing attributes of torch (functions, methods) so that they can be put back.

Global mode replaces a few of torch's functions whose pluggable-allocator versions raise
or do nothing (_record_stream.py, _torch_memory.py); the step hooks replace torch's step
patcher, Optimizer.load_state_dict and steps torch wrapped before the install
(_optim_hooks.py). Each replacement keeps the original as its __wrapped__ and in a
Patches object, whose remove() restores every one of them.
"""

from __future__ import annotations


_INHERITED = object()  # the attribute came from a base class: removing ours uncovers it


class Patches:
    def __init__(self):
        self._originals: list[tuple[object, str, object]] = []

    def replace(self, owner, name: str, fn) -> None:
        """owner.name = fn, remembering what was there (fn.__wrapped__ names it too). A
        staticmethod or classmethod is remembered as the descriptor itself, so that
        putting it back does not turn it into a plain method."""
        original = getattr(owner, name)
        function = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        function.__wrapped__ = original
        function.__doc__ = function.__doc__ or original.__doc__
        self._originals.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, fn)

    def replace_in_cell(self, cell, value) -> None:
        """cell.cell_contents = value, remembering what was there: a variable of closures
        made before the install (an LR scheduler's wrapper of optimizer.step, Note [a step
        that raises] in _optim_hooks.py), which no attribute reaches."""
        self._originals.append((cell, "cell_contents", cell.cell_contents))
        cell.cell_contents = value

    def remove(self) -> None:
        """Puts every original back (latest first); a second call does nothing."""
        while self._originals:
            owner, name, original = self._originals.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
