"""tidepool.optim.Apollo's `state`: what torch.optim keeps in `optimizer.state`, read from
the C++ optimizer that holds it (Note [Apollo's state as torch.optim shows it]).

Note [Apollo's state as torch.optim shows it]: Apollo's state lives in C++, in its
placement (device, host or tiered). Code written for torch.optim reads `optimizer.state`
to learn whether there is state and what it holds, and one reader acts on the answer:
torch.distributed.checkpoint's get/set_optimizer_state_dict take a step with zero
gradients and lr 0 whenever `optimizer.state` is empty and no gradient is set, which is
how it finds the state's form before loading into it. With an always-empty `state` that
step came at every checkpoint taken after zero_grad (review finding: the step count and
m, B, d moved each time), and on a fresh optimizer it moved the parameters (during the
warmup Apollo's lr is the ramp's, not the group's, so lr 0 does not hold them still, and
weight decay acts). So `state` shows, for each parameter the C++ optimizer steps:

- its state (step, exp_avg_grad, approx_hessian, update), host copies read when asked;
- for one that requires grad and has no state yet, the state its first step starts
  from: step 0 and zeros, which is the same thing (state_dict() gives the same, and
  loading it gives the same first step as none).

It is read-only: the state changes through step() and load_state_dict() only, so an
assignment raises instead of being lost.
"""

from __future__ import annotations

import collections.abc
import types
import weakref

import torch

STATE_KEYS = ("exp_avg_grad", "approx_hessian", "update")

_READ_ONLY = ("tidepool.optim.Apollo: state is read-only (it lives in the C++ optimizer): "
              "step() and load_state_dict() change it")


def param_state(param: torch.Tensor, saved) -> dict:
    """One parameter's state as torch.optim and the published Apollo name it, from the
    binding's (step, m, B, d) or None (no state yet: step 0 and zeros)."""
    if saved is None:
        zeros = torch.zeros(param.shape, dtype=param.dtype)
        return {"step": 0, **{key: zeros.clone() for key in STATE_KEYS}}
    step, *tensors = saved
    return {"step": step, **dict(zip(STATE_KEYS, tensors))}


def shown(param: torch.Tensor, has_state: bool) -> bool:
    """Whether `state` shows a parameter: one with state, or one that requires grad."""
    return has_state or param.requires_grad


class _Items(collections.abc.ItemsView):
    def __iter__(self):
        return self._mapping._items()


class _Values(collections.abc.ValuesView):
    def __iter__(self):
        return (entry for _, entry in self._mapping._items())


class ApolloState(collections.abc.Mapping):
    """Apollo.state: {parameter: {'step', 'exp_avg_grad', 'approx_hessian', 'update'}},
    keyed by the parameter tensors themselves (by identity, as torch.optim's dict is)."""

    __slots__ = ("_optimizer",)

    def __init__(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def _shown(self) -> list:
        """(index, parameter) of each parameter shown, numbered as the C++ optimizer
        numbers them."""
        optimizer = self._optimizer()
        apollo = getattr(optimizer, "_apollo", None)
        if apollo is None:  # torch.optim.Optimizer.__init__, before the C++ optimizer
            return []
        with optimizer._lock:  # a step in another thread adds to the C++ state
            params = [p for group in optimizer._stepped for p in group]
            with_state = apollo.parameters_with_state()
        return [(i, p) for i, (p, has) in enumerate(zip(params, with_state)) if shown(p, has)]

    def __len__(self) -> int:
        return len(self._shown())

    def __iter__(self):
        return iter([p for _, p in self._shown()])

    def __contains__(self, param) -> bool:
        return any(p is param for _, p in self._shown())

    def _entry(self, index: int, param) -> types.MappingProxyType:
        optimizer = self._optimizer()
        with optimizer._lock:
            saved = optimizer._apollo.saved_param_state(index)
        return types.MappingProxyType(param_state(param, saved))

    def __getitem__(self, param) -> types.MappingProxyType:
        for index, p in self._shown():
            if p is param:
                return self._entry(index, p)
        raise KeyError("tidepool.optim.Apollo: not a parameter of this optimizer with state")

    # items() and values() walk the parameters once: Mapping's own look each key up
    # again, and each lookup walks the parameter list, so iterating them was quadratic.
    def items(self) -> _Items:
        return _Items(self)

    def values(self) -> _Values:
        return _Values(self)

    def _items(self):
        for index, p in self._shown():
            yield p, self._entry(index, p)

    def __setitem__(self, param, value) -> None:
        raise TypeError(_READ_ONLY)

    def __delitem__(self, param) -> None:
        raise TypeError(_READ_ONLY)

    def clear(self) -> None:
        raise TypeError(_READ_ONLY)

    def __repr__(self) -> str:
        return f"<tidepool.optim.Apollo state: {len(self)} parameters>"
