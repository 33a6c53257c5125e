"""tidepool.evict() and tidepool.prefetch() of an optimizer's state or of tensors: the
pointers to hand the tiering C ABI's calls by pointers (tidepool_evict_ptrs,
tidepool_prefetch_ptrs), device by device, where the tag form moves all of a tag."""

from __future__ import annotations

import sys

from . import _state_tensors

WHAT = "a tag (a name or an id), a torch.optim.Optimizer, a tensor or an iterable of tensors"


def pointers(what, device: int | None, one_stream: bool) -> dict[int, list[int]]:
    """device -> the pointers that name `what` there: an optimizer's state tensors on
    CUDA devices, as the pre-step hook names them (Note [prefetch by pointer] in
    _state_moves.py), its state elsewhere (a CPU step counter) left out; or the storages
    of CUDA tensors (a wrapper subclass's, such as a DTensor's, through its local
    tensors). `device` (None: every device) keeps an optimizer's state on that device
    only, and a tensor on another is a ValueError, as is a tensor not on a CUDA device.
    `one_stream`: the caller names one stream, which cannot serve several devices
    (ValueError)."""
    # no torch imported: nothing here can be an optimizer or a tensor
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(what, torch.optim.Optimizer):
        by_device = _state_tensors._state_pointers(what, every_parameter=True)
        if device is not None:
            by_device = {device: by_device[device]} if device in by_device else {}
    else:
        by_device = _tensor_pointers(torch, what, device)
    if one_stream and len(by_device) > 1:
        raise ValueError(f"tidepool: a stream serves one device, and the tensors are on "
                         f"{', '.join(f'cuda:{d}' for d in sorted(by_device))}; pass device=")
    return by_device


def _tensor_pointers(torch, tensors, device: int | None) -> dict[int, list[int]]:
    if torch is not None and isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    try:
        tensors = iter(tensors)
    except TypeError:
        raise TypeError(f"tidepool: evict and prefetch take {WHAT}, "
                        f"not {type(tensors).__name__}") from None
    by_device: dict[int, list[int]] = {}
    for tensor in tensors:
        if torch is None or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tidepool: evict and prefetch take {WHAT}; the iterable holds "
                            f"a {type(tensor).__name__}")
        for part in _state_tensors._plain_parts(tensor, any_tensor=True):
            d = _state_tensors._cuda_index(part)
            if d < 0:
                raise ValueError(f"tidepool: a tensor on {part.device} is not in CUDA memory; "
                                 "evict and prefetch move CUDA tensors")
            if device is not None and d != device:
                raise ValueError(f"tidepool: a tensor on cuda:{d} was given with device={device}")
            by_device.setdefault(d, []).append(_storage_pointer(part))
    return by_device


def _storage_pointer(tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError) as e:  # sparse, and other layouts without one
        raise ValueError(
            f"tidepool: a {tensor.layout} tensor has no storage to move ({e})") from None
