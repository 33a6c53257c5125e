"""Note [a step captured in a CUDA graph]: the documented whole-network capture (warm-up
steps, then torch.cuda.graph(g) around forward, backward and optimizer.step() with
capturable=True; PyTorch's "CUDA Graphs" notes) runs the step hooks while the stream is
capturing. The post-hook's eviction synchronizes tidepool's copy streams with the
step's, which a capturing stream does not allow (the capture is invalidated), and a
prefetch would be recorded into the graph. And the graph's replays run no hooks at all,
so no move made around the captured step would be repeated around them. So the hooks
leave a captured step alone, as they do an optimizer that keeps its state itself: no
scope, no tag, no move. Its state stays where the step before the capture left it
(evicted, when the warm-up steps ran with the hooks: pointer-stable, so the replays still
find it, over the link); tidepool.prefetch(optimizer) before the capture brings it to
device memory, where the replays then find it. Said once per process.
"""

from __future__ import annotations

import warnings

from . import _install

_said = False
_ask = None  # is_current_stream_capturing, out of torch.compile's reach (_capturing)


def _capturing() -> bool:
    """torch.cuda.is_current_stream_capturing(), asked eagerly: under torch.compile the
    hooks run inside the traced step, where Dynamo would put the question into the graph
    (evaluated once, at trace time) instead of asking it at each step."""
    global _ask
    if _ask is None:
        torch = _install.STATE.torch
        _ask = torch.compiler.disable(lambda: torch.cuda.is_current_stream_capturing())
    return _ask()


def captured(optimizer, devices: list) -> bool:
    """Whether this step of `optimizer` (its parameters on CUDA `devices`) is being
    captured in a CUDA graph; says so, once per process."""
    global _said
    if not devices:
        return False
    try:
        capturing = bool(_capturing())
    except Exception:  # noqa: BLE001  (no CUDA to ask: nothing is captured)
        return False
    if capturing and not _said and (_install.STATE.config or {}).get("log") != "off":
        _said = True
        warnings.warn(
            f"tidepool: {type(optimizer).__qualname__}.step() is being captured in a CUDA "
            f"graph; the graph's replays run no step hooks, so tidepool moves nothing for "
            f"this step: its state stays where it is now. Call tidepool.prefetch(optimizer) "
            f"before the capture to keep it in device memory", _install.TidepoolInactiveWarning,
            stacklevel=4)
    return capturing
