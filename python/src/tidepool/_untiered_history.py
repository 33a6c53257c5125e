"""A hint for users of the published AADL (ORNL/AADL) under the drop-in: its
AADL.accelerate(optimizer, ...) keeps the history, history_depth flattened copies of the
parameters, in `optimizer.acc_param_hist` (one deque per parameter group), appended after
each step outside it and outside optimizer.state, so no step hook tags or tiers it; on
the device (its default history_device) it is often the largest memory the optimizer
holds. tidepool.optim.accelerate takes the same options and keeps that history in host
memory, streamed through the device chunk by chunk; the pre-step hook says so, once per
process, when it finds such a history in device memory.
"""

from __future__ import annotations

import warnings

from . import _install

_REFERENCE_HISTORY = "acc_param_hist"
_said = False


def check(optimizer) -> None:
    global _said
    if _said:
        return
    history = getattr(optimizer, _REFERENCE_HISTORY, None)
    if not isinstance(history, (list, tuple)):
        return
    tensors = [t for group in history for t in (group if hasattr(group, "__iter__") else ())
               if hasattr(t, "device") and t.device.type != "cpu"]
    if not tensors or (_install.STATE.config or {}).get("log") == "off":
        return
    _said = True
    mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    devices = ", ".join(sorted({str(t.device) for t in tensors}))
    warnings.warn(
        f"tidepool: {type(optimizer).__qualname__}: the AADL history of this optimizer "
        f"(optimizer.{_REFERENCE_HISTORY}: {len(tensors)} "
        f"vector{'s' if len(tensors) > 1 else ''}, {mib:.1f} MiB on "
        f"{devices}) is kept outside optimizer.state, where tidepool does not tier it; "
        f"tidepool.optim.accelerate(optimizer, ...) takes the same options and keeps the "
        f"history in host memory (python/README.md)", _install.TidepoolInactiveWarning,
        stacklevel=3)
