"""The optimizer steps in flight on each device, across threads: what decides whether a
step that ends may evict the device's whole optimizer_state tag (Note [steps in flight]).

Note [steps in flight]: the post-hook evicts the device's optimizer_state by tag (Note
[evict by tag] in _state_moves.py), which takes every optimizer's state there. With two
threads stepping optimizers on one device at once (two models trained in two threads),
one thread's eviction would move the other's state to the host in the middle of its
step: its kernels would then reach it over the link, and a prefetch just done would be
undone. So every step counts itself in on the devices whose scope it holds (begin, in the
pre-hook, before its prefetch), and out when its scope closes (end). A step that ends
while another thread's step on the device is still in flight evicts only its own state,
by pointer (tidepool_evict_ptrs: its optimizer's state tensors and those of optimizers
stepped inside it, Lookahead's inner one). The last step to end on a device evicts by
tag, as a step alone always did, which also takes what pointers cannot name (state kept
outside optimizer.state, and what the earlier steps' by-pointer evictions left).

While that last step evicts the tag, a step that begins on the device waits in begin
until the eviction is done: counted in earlier, its prefetch would race the eviction. A
step's own scope is all that counts: a step nested in another on the same thread (a
subclass's step() calling its base's, Lookahead stepping its inner optimizer) holds no
device of its own there (_devices_not_held) and counts nothing. The closure of
step(closure), which runs with the step's scope closed (Note [closures]), stays counted
in: the step is still in flight. A load_state_dict that takes state in (Note [loaded
state]) counts as a step. A scope an unguarded step left open when it raised (Note [a
step that raises]) counts until the next step on its thread closes it.

Note [steps in flight in pool mode]: in pool mode the state lives in the segments
PyTorch's caching allocator takes from tidepool's MemPool, and it packs the state of
different optimizers into one segment (a discriminator's and a generator's bias moments in
one 2 MiB segment; tensors of 1 to 10 MiB share 20 MiB segments), which is one
pointer-stable range: moving "this optimizer's ranges" moves the others' state in them
too. While another thread's step is in flight on the device, whose kernels may be
reading or writing that state, a migration under them could lose their writes. So in
pool mode a step moves state by pointer only while it is alone on the device: its
prefetch runs only when no other step is in flight there, with later steps waiting in
begin until it is done (prefetching_alone), and a step that ends while another is in
flight evicts nothing (the last one evicts the tag). The steps that overlap another use
their state where it is, in host memory through the mapping. (In global mode every state
tensor of at least tidepool.tier_min_bytes is a range of its own, shared with nothing.)
"""

from __future__ import annotations

import contextlib
import threading

_condition = threading.Condition()
_steps: dict[int, int] = {}  # device -> steps in flight on it, over all threads
# Devices where a step alone moves state (its tag evicted; in pool mode also a prefetch):
# a step that begins there waits.
_moving: set[int] = set()


def begin(devices: list[int]) -> None:
    """A step begins on `devices` (those it holds): counts it in, once no eviction of the
    tag on one of them is running (Note [steps in flight]), nor a prefetch of a step alone
    there in pool mode (Note [steps in flight in pool mode])."""
    if not devices:
        return
    with _condition:
        _condition.wait_for(lambda: _moving.isdisjoint(devices))
        for d in devices:
            _steps[d] = _steps.get(d, 0) + 1
    # The C side too, on this thread (Note [Steps of other threads] in
    # tiering/steps_in_flight.cpp): another thread's out-of-memory then leaves this step's
    # state where it is. Should that fail, the step was never counted in.
    try:
        note_in_c(devices, begins=True)
    except BaseException:
        _count_out(devices)
        raise


def note_in_c(devices: list[int], begins: bool) -> None:
    """Tells the C side that a step on `devices` begins (or goes on) on this thread, or
    ends (or waits for its closure: Note [Steps of other threads]). A begin that fails
    part-way is taken back."""
    from . import _tiering
    done = []
    try:
        for d in devices:
            _tiering.note_step(d, begins=begins)
            done.append(d)
    except BaseException:
        if begins:
            for d in done:
                _tiering.note_step(d, begins=False)
        raise


def end(devices: list[int]) -> None:
    """The step that began on `devices` is over (on the thread where it began)."""
    if not devices:
        return
    try:
        note_in_c(devices, begins=False)
    finally:
        _count_out(devices)


def _count_out(devices: list[int]) -> None:
    with _condition:
        for d in devices:
            left = _steps.get(d, 0) - 1
            if left > 0:
                _steps[d] = left
            else:
                _steps.pop(d, None)


@contextlib.contextmanager
def evicting(devices: list[int]):
    """For a step that ended on `devices`: (by_tag, by_pointer), the devices no step is in
    flight on, whose tag this caller evicts inside the block (a step that begins there
    waits until the block is left), and those where another thread's step still runs or
    moves state, where it evicts only its own state (Note [steps in flight]; in pool mode
    nothing, Note [steps in flight in pool mode])."""
    with _condition:
        by_tag = [d for d in devices if d not in _steps and d not in _moving]
        _moving.update(by_tag)
    try:
        yield by_tag, [d for d in devices if d not in by_tag]
    finally:
        _moved(by_tag)


@contextlib.contextmanager
def prefetching_alone(devices: list[int]):
    """For a step counted in on (or nested in a step on) `devices`: those where it is the
    only step in flight and nothing is moved, for it to prefetch inside the block; a step
    that begins there meanwhile waits until the block is left (Note [steps in flight in
    pool mode])."""
    with _condition:
        alone = [d for d in devices if _steps.get(d, 0) <= 1 and d not in _moving]
        _moving.update(alone)
    try:
        yield alone
    finally:
        _moved(alone)


def _moved(devices: list[int]) -> None:
    if devices:
        with _condition:
            _moving.difference_update(devices)
            _condition.notify_all()


def in_flight() -> dict[int, int]:
    """device -> steps in flight on it (for tests and diagnostics)."""
    with _condition:
        return dict(_steps)
