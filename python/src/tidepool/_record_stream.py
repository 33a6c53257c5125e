"""torch.Tensor.record_stream, connected to tidepool in global mode.

PyTorch's CUDAPluggableAllocator ignores record_stream unless a record-stream function
is set on it, and its Python class cannot set one (Note [record_stream from PyTorch] in
allocator/c_api.h). Without it, a tensor that another stream still reads is handed out
again on its allocating stream as soon as it is freed: a silent data race. So in global
mode the package wraps torch.Tensor.record_stream: PyTorch's own method runs first (its
checks and errors stay as they are), then tidepool_pytorch_record_stream holds the
memory until that stream has passed the point of the call. Memory tidepool did not hand
out is left alone, as PyTorch's allocator does. record_stream called from C++ inside
PyTorch does not pass through here; in a LibTorch trainer install_from_env connects it
in C++.
"""

from __future__ import annotations

import ctypes

from . import _lib, _patches


def _cuda_stream_handle(stream) -> int:
    """The cudaStream_t of a torch.cuda.Stream, or of a device-generic torch.Stream (which
    has no cuda_stream: torch.Stream(device="cuda"), torch.accelerator.current_stream())."""
    if hasattr(stream, "cuda_stream"):
        return stream.cuda_stream
    import torch
    return torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type).cuda_stream


def record_in_tidepool(tensor, stream) -> None:
    """Makes tidepool hold `tensor`'s memory until `stream` passes this point."""
    if not tensor.is_cuda:
        return
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is not None:
        # A wrapper subclass (DTensor and the like) has no storage of its own; its inner
        # tensors hold the memory, and PyTorch's method reached them through dispatch.
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            record_in_tidepool(getattr(tensor, name), stream)
        return
    ptr = tensor.untyped_storage().data_ptr()
    if ptr == 0:  # empty storage: nothing was allocated
        return
    fn = _lib.function("tidepool_pytorch_record_stream", "record_stream for PyTorch")
    _lib.check(fn(ctypes.c_void_p(ptr), ctypes.c_void_p(_cuda_stream_handle(stream))),
               "record_stream")


def register(torch) -> _patches.Patches:
    """Wraps torch.Tensor.record_stream; remove() on the result undoes it."""
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        result = original(self, stream)
        record_in_tidepool(self, stream)
        return result

    record_stream.__name__ = original.__name__
    patches = _patches.Patches()
    patches.replace(torch.Tensor, "record_stream", record_stream)
    return patches
