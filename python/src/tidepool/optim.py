"""tidepool.optim: Apollo and AADL (Anderson acceleration) for Python trainers, with their
state where you choose to keep it.

    opt = tidepool.optim.Apollo(model.parameters(), lr=0.01, state="tiered")
    aadl = tidepool.optim.AADL(torch.optim.SGD(model.parameters(), lr=0.1),
                               relaxation=0.5, history_depth=5)          # history on the host

Both run tidepool's C++ optimizers (optimizers/apollo.h, optimizers/aadl.h) through the
binding tidepool._optim (python/binding/optim_module.cpp): the same step as a C++ trainer
gets, which follows the published Python references (the golden trajectories in
../shared/golden pin it down), but with

  - Apollo's elementwise work fused into one pass per parameter (CUDA kernels, or the host
    loop for CPU tensors) and its three state tensors wherever `state` says;
  - AADL's history (history_depth flattened copies of the parameters) in host memory by
    default, streamed through the device chunk by chunk for each pass, never stacked into
    one N x k matrix on the device, and its least-squares problem solved in fp64.

Where the state lives (`state=` for Apollo, `history=` for AADL):
  "device"  resident on the parameters' device (Apollo's default);
  "host"    in host memory, pinned for CUDA parameters, copied onto the device around
            each use (AADL's default; for CPU parameters it is the same as "device");
  "tiered"  in tidepool's tiered store: host memory, brought onto the device ahead of
            use under a device budget (`state_budget=`/`history_budget=` bytes; None:
            tidepool.state_budget when it is configured above 0, else a 1 GiB budget of
            the store's own). It needs the
            backend tidepool's allocators use in this process to be the parameters' (cuda
            for CUDA parameters; host, i.e. no GPU, for CPU ones).

Apollo is a torch.optim.Optimizer: param groups, LR schedulers (their changes to a
group's options reach the next step), zero_grad, step(closure), state_dict() in the
reference's format (per parameter: step, exp_avg_grad, approx_hessian, update), so
checkpoints of the published Apollo load here and the other way round. Its state lives in
the C++ optimizer: `self.state` shows it read-only, as torch.optim keys it (Note [Apollo's
state as torch.optim shows it] in _apollo_state.py), and state_dict() copies it out.

AADL wraps any torch.optim optimizer (it steps it, then accelerates) and takes the
options of the reference's AADL.accelerate(optimizer, ...). Its state_dict() holds the
inner optimizer's state_dict and its own history. accelerate(optimizer, ...) does what
the reference's does: the optimizer's own step() is accelerated from then on.

The drop-in's step hooks (PYTORCH_CUDA_ALLOC_CONF=backend:tidepool) leave these optimizers
alone, since they keep their state themselves; an AADL's inner optimizer is a
plain torch.optim one, whose state the hooks tier as usual.
"""

from __future__ import annotations

import importlib.util
import functools
import itertools
import threading
import types
import weakref

import torch

from . import _apollo_state, _lib

__all__ = ["Apollo", "AADL", "accelerate"]

_PLACEMENTS = ("device", "host", "tiered")
_APOLLO_OPTIONS = ("lr", "beta", "eps", "rebound", "warmup", "init_lr", "base_lr",
                   "weight_decay", "weight_decay_type")
_APOLLO_STATE = _apollo_state.STATE_KEYS

_binding = None
_binding_lock = threading.Lock()


def _module():
    """tidepool._optim, loaded on first use (after libtidepool, which it links: the
    dynamic loader then resolves it to the copy this package uses)."""
    global _binding
    with _binding_lock:
        if _binding is None:
            _lib.load()
            path = _lib.optim_module_path()
            spec = importlib.util.spec_from_file_location("tidepool._optim", path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except ImportError as e:
                raise _lib.LibraryError(
                    f"cannot load {path}: {e}; it must be built against this torch "
                    f"({torch.__version__})") from e
            _binding = module
        return _binding


def _check_placement(where, budget, what: str) -> None:
    if where not in _PLACEMENTS:
        raise ValueError(f"tidepool.optim: {what}={where!r} is not one of "
                         f"{', '.join(repr(p) for p in _PLACEMENTS)}")
    if budget is None:
        return
    if where != "tiered":
        raise ValueError(f"tidepool.optim: {what}_budget applies to {what}='tiered' only, "
                         f"not {what}={where!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"tidepool.optim: {what}_budget must be a positive number of bytes, "
                         f"not {budget!r}")


def _check_plain_parameters(params, who: str) -> None:
    """Refuses, before anything is made, a parameter of a tensor subclass that dispatches
    its operations itself (__torch_dispatch__): FSDP2's and tensor parallelism's DTensor
    above all. The C++ step reads a parameter's memory directly (the fused step through
    its data pointer, which such a wrapper does not have; a DTensor's data is its local
    shard) and mixes it with the plain tensors of its state, and Apollo's sums and AADL's
    inner products would have to span the shards of every rank. Not supported yet: the
    drop-in (PYTORCH_CUDA_ALLOC_CONF=backend:tidepool) tiers the state of stock
    torch.optim optimizers on DTensor parameters."""
    plain = torch.Tensor.__torch_dispatch__
    for index, p in enumerate(params):
        if getattr(type(p), "__torch_dispatch__", plain) is not plain:
            raise TypeError(
                f"tidepool.optim.{who}: parameter {index} is a {type(p).__name__}, a tensor "
                f"subclass that dispatches its own operations (FSDP2's and tensor "
                f"parallelism's DTensor are); {who} steps plain tensors only. For sharded "
                f"training, use a stock torch.optim optimizer with the drop-in "
                f"(PYTORCH_CUDA_ALLOC_CONF=backend:tidepool), which tiers its state.")


def _one_call_at_a_time(method):
    """Note [one call at a time]: the C++ optimizers are not thread-safe, and their step,
    state_dict and load_state_dict let go of the GIL (a background thread checkpointing
    during a step read state the step held, or raced the first step's state table, review
    finding); these calls of one optimizer wait for each other (torch's own optimizers
    would at worst give a torn state_dict). Reentrant: a closure may call them."""
    @functools.wraps(method)
    def one_at_a_time(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return one_at_a_time


def _name_the_same_parameters(param_groups, given) -> bool:
    """Whether `param_groups` still name, group by group and in order, the very tensors of
    `given` (lists of the tensors the C++ optimizer was handed), which it steps whatever
    param_groups say."""
    return len(param_groups) == len(given) and all(
        len(g["params"]) == len(tensors) and all(a is b for a, b in zip(g["params"], tensors))
        for g, tensors in zip(param_groups, given))


class Apollo(torch.optim.Optimizer):
    """Apollo (Ma 2020), as the published reference (XuezheMax/apollo, optim/apollo.py)
    takes it, with its state where `state` says (see the module's docstring).

    Options as the reference's: lr (required, > 0), beta, eps, rebound ("constant" |
    "belief"), warmup (steps over which the lr ramps from init_lr), init_lr (default
    lr/1000), weight_decay, weight_decay_type ("L2" | "decoupled" | "stable"; default L2
    for constant rebound, decoupled for belief). As in the reference, these defaults
    come from the constructor's arguments: a group that gives only its own lr ramps to
    the constructor's lr (base_lr) during the warmup and steps with its own after.
    fused=False runs the reference's sequence of tensor operations instead of the fused
    step (the same results within rounding; slower). bfloat16 and float16 parameters
    always take that path, in their own dtype, as the reference computes.
    """

    # The drop-in's step hooks leave this optimizer alone: its state lives in C++.
    _tidepool_owns_state = True

    def __init__(self, params, lr, beta=0.9, eps=1e-4, rebound="constant", warmup=500,
                 init_lr=None, weight_decay=0.0, weight_decay_type=None, *, state="device",
                 state_budget=None, fused=True):
        _check_placement(state, state_budget, "state")
        # Note [one call at a time]: step, state_dict, load_state_dict and add_param_group.
        self._lock = threading.RLock()
        defaults = _module().resolved_apollo_options(dict(
            lr=lr, beta=beta, eps=eps, rebound=rebound, warmup=warmup, init_lr=init_lr,
            base_lr=None, weight_decay=weight_decay, weight_decay_type=weight_decay_type))
        super().__init__(params, defaults)
        _check_plain_parameters([p for g in self.param_groups for p in g["params"]], "Apollo")
        groups = [(list(g["params"]), _options_of(g)) for g in self.param_groups]
        self._apollo = _module().Apollo(groups, state, state_budget, self.defaults)
        self._apollo.fused = bool(fused)
        # The parameters the C++ optimizer steps, group by group (step() checks that
        # param_groups still names them).
        self._stepped = [list(params) for params, _ in groups]
        self._state_placement = state
        for index, group in enumerate(self.param_groups):
            group.update(self._apollo.options(index))  # init_lr, base_lr, ... as resolved

    def __getstate__(self):
        raise TypeError("tidepool.optim.Apollo cannot be pickled (its state lives in C++); "
                        "save its state_dict() instead")

    @property
    def state(self) -> _apollo_state.ApolloState:
        """{parameter: {'step', 'exp_avg_grad', 'approx_hessian', 'update'}} as torch.optim
        keys it, read-only, host copies read when asked; a parameter that requires grad
        and has not stepped shows step 0 and zeros (Note [Apollo's state as torch.optim
        shows it])."""
        return self._state_view

    @state.setter
    def state(self, value) -> None:
        if "_state_view" not in self.__dict__ and not value:  # torch.optim's __init__
            self._state_view = _apollo_state.ApolloState(self)
            return
        raise TypeError("tidepool.optim.Apollo: state cannot be replaced (it lives in the C++ "
                        "optimizer); load_state_dict() replaces what it holds")

    @property
    def placement(self) -> str:
        """Where the state lives: "device", "host" or "tiered"."""
        return self._state_placement

    @property
    def fused(self) -> bool:
        return self._apollo.fused

    @fused.setter
    def fused(self, enabled: bool) -> None:
        self._apollo.fused = bool(enabled)

    def placement_stats(self) -> dict:
        """What the state's placement moved and holds: "placement" (the C++ placement's
        name: resident, host_staged or tiered), bytes_to_device and bytes_to_host (host
        and tiered), and for tiered the store's figures (state_bytes, device_budget_bytes,
        device_peak_bytes, prefetch_hits, misses, evictions, ...)."""
        return self._apollo.placement_stats()

    @_one_call_at_a_time
    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        apollo = getattr(self, "_apollo", None)
        if apollo is None:  # torch.optim.Optimizer.__init__ adding the first groups
            return
        group = self.param_groups[-1]
        try:
            _check_plain_parameters(group["params"], "Apollo")
            # torch.optim only warns about a parameter twice in one group; the C++ step
            # would refuse every step from then on (the group cannot be taken out).
            if len({id(p) for p in group["params"]}) != len(group["params"]):
                raise ValueError("tidepool.optim.Apollo: a parameter appears more than once "
                                 "in the group; give each parameter once")
            apollo.add_param_group(list(group["params"]), _options_of(group))
        except BaseException:
            self.param_groups.pop()
            raise
        self._stepped.append(list(group["params"]))
        group.update(apollo.options(len(self.param_groups) - 1))

    @_one_call_at_a_time
    def step(self, closure=None):
        """One Apollo step for every parameter with a gradient; with a closure, calls it
        first (grad mode on) and returns what it returned, as torch.optim does: the update
        does not use it (review finding: a number came back as a float64 tensor, and a
        closure returning (loss, outputs) was refused). A step it refuses (sparse
        gradients, a dtype other than float32, float64, bfloat16 or float16, invalid
        options) raises and changes no parameter or state."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_parameters()
        self._send_options()
        self._apollo.step(None)
        return loss

    def _check_parameters(self) -> None:
        """Review finding: a group's "params" replaced (HF Accelerate's parameter switch
        does it) or a group removed left the C++ optimizer stepping the tensors it was
        given, and the new ones never, without a word."""
        if _name_the_same_parameters(self.param_groups, self._stepped):
            return
        raise RuntimeError("tidepool.optim.Apollo: param_groups no longer name the parameters "
                           "the optimizer was given (a group's 'params' replaced, or a group "
                           "removed); it steps those it was given: make a new optimizer, and "
                           "load this one's state_dict() into it")

    def _send_options(self) -> None:
        for index, group in enumerate(self.param_groups):
            self._apollo.set_options(index, _options_of(group))

    @_one_call_at_a_time
    def state_dict(self) -> dict:
        """{'state': {index: {'step', 'exp_avg_grad', 'approx_hessian', 'update'}},
        'param_groups': [...]} as torch.optim and the reference make it (parameters
        numbered across groups in order); the tensors are host copies. It holds what
        `state` shows: a parameter that requires grad and has not stepped has step 0 and
        zeros. The state_dict hooks torch.optim.Optimizer offers
        (register_state_dict_pre_hook, ...) run as there."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # Numbered by the groups as they are now, as "param_groups" below: after a group
        # was removed or its "params" replaced, this is what a new optimizer over those
        # groups loads (the C++ optimizer still numbers the tensors it was given, and its
        # numbers had gone into the state: review finding).
        saved_all = self._apollo.saved_state()
        stepped_at = {id(p): i for i, p in
                      enumerate(itertools.chain.from_iterable(self._stepped))}
        state = {}
        current = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for index, p in enumerate(current):
            at = stepped_at.get(id(p))
            saved = saved_all[at] if at is not None else None
            if _apollo_state.shown(p, saved is not None):
                state[index] = _apollo_state.param_state(p, saved)
        packed, start = [], 0
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            packed.append(entry)
        state_dict = {"state": state, "param_groups": packed}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @_one_call_at_a_time
    def load_state_dict(self, state_dict) -> None:
        """Loads a state_dict of this class or of the published Apollo: everything is
        checked and copied into this optimizer's placement before anything changes, so a
        refused one (ValueError naming what) leaves the optimizer as it was. The state_dict
        hooks torch.optim.Optimizer offers run as there."""
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        saved_groups, saved_state = _unpack_state_dict(state_dict)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"tidepool.optim.Apollo: the state_dict has {len(saved_groups)} parameter "
                f"groups, this optimizer {len(self.param_groups)}")
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"tidepool.optim.Apollo: group {index} of the state_dict has "
                    f"{len(saved['params'])} parameters, this optimizer's {len(group['params'])}")
        position = {pid: i for i, pid in
                    enumerate(itertools.chain.from_iterable(g["params"] for g in saved_groups))}
        states = [None] * len(position)
        for key, value in saved_state.items():
            if key not in position:
                raise ValueError(f"tidepool.optim.Apollo: the state_dict has state for "
                                 f"parameter {key!r}, which none of its groups lists")
            states[position[key]] = _apollo_param_state(key, value)
        options = []
        for index, saved in enumerate(saved_groups):
            missing = [k for k in ("lr", "beta", "eps", "rebound", "warmup", "weight_decay")
                       if k not in saved]
            if missing:
                raise ValueError(f"tidepool.optim.Apollo: group {index} of the state_dict "
                                 f"lacks {', '.join(missing)}")
            options.append({k: saved.get(k) for k in _APOLLO_OPTIONS})
        self._apollo.restore_state(options, states)
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            group.update({k: v for k, v in saved.items() if k != "params"})
            group.update(self._apollo.options(index))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _options_of(group: dict) -> dict:
    return {k: group[k] for k in _APOLLO_OPTIONS}


def _unpack_state_dict(state_dict):
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict \
            or "state" not in state_dict:
        raise ValueError("tidepool.optim.Apollo: not an optimizer state_dict (a dict with "
                         "'state' and 'param_groups')")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in groups):
        raise ValueError("tidepool.optim.Apollo: the state_dict's param_groups are not a list "
                         "of dicts with 'params'")
    if not isinstance(state, dict):
        raise ValueError("tidepool.optim.Apollo: the state_dict's state is not a dict")
    return groups, state


def _apollo_param_state(key, value) -> tuple:
    """(step, m, B, d) of one parameter's saved state, checked for form (the C++ side
    checks shapes and values)."""
    if not isinstance(value, dict):
        raise ValueError(f"tidepool.optim.Apollo: the state of parameter {key!r} is not a dict")
    missing = [k for k in ("step",) + _APOLLO_STATE if k not in value]
    if missing:
        raise ValueError(f"tidepool.optim.Apollo: the state of parameter {key!r} lacks "
                         f"{', '.join(missing)}")
    step = value["step"]
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            raise ValueError(f"tidepool.optim.Apollo: 'step' of parameter {key!r} is not a "
                             "single number")
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"tidepool.optim.Apollo: 'step' of parameter {key!r} is {step!r}, "
                         "not a count of steps")
    tensors = []
    for name in _APOLLO_STATE:
        if not isinstance(value[name], torch.Tensor):
            raise ValueError(f"tidepool.optim.Apollo: {name!r} of parameter {key!r} is not a "
                             "tensor")
        tensors.append(value[name])
    return (step, *tensors)


class AADL:
    """Anderson acceleration (the published AADL, ORNL/AADL) around `optimizer`, any
    torch.optim optimizer: step() steps it, stores the parameters in the history and, as
    the options say, replaces them by the extrapolated iterate (with a closure, only when
    its loss is lower: the reference's safeguard).

    Options as AADL.accelerate's: acceleration_type ("anderson" |
    "anderson_normal_equation"; both solve the same least-squares problem here, in fp64),
    relaxation, wait_iterations, history_depth (≥ 3), store_each_nth, frequency, reg_acc.
    `history` and `history_budget`: see the module's docstring. Change learning rates
    on the inner optimizer (an LR scheduler takes it, or this object: param_groups are the
    inner optimizer's).
    """

    def __init__(self, optimizer, acceleration_type="anderson", relaxation=0.1,
                 wait_iterations=1, history_depth=15, store_each_nth=1, frequency=1,
                 reg_acc=0.0, *, history="host", history_budget=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"tidepool.optim.AADL wraps a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
        _check_placement(history, history_budget, "history")
        _check_plain_parameters([p for g in optimizer.param_groups for p in g["params"]],
                                "AADL")
        self._options = dict(acceleration_type=acceleration_type, relaxation=relaxation,
                             wait_iterations=wait_iterations, history_depth=history_depth,
                             store_each_nth=store_each_nth, frequency=frequency,
                             reg_acc=reg_acc)
        self._lock = threading.RLock()  # Note [one call at a time]
        self._inner = optimizer
        self._params = [list(g["params"]) for g in optimizer.param_groups]
        self._inner_step = _InnerStep(optimizer)
        self._aadl = _module().AADL(self._params, self._inner_step, self._options,
                                    history, history_budget)
        self._history_placement = history

    def __getstate__(self):
        raise TypeError("tidepool.optim.AADL cannot be pickled (its history lives in C++); "
                        "save its state_dict() instead")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer."""
        return self._inner

    @property
    def param_groups(self) -> list:
        return self._inner.param_groups

    @property
    def state(self):
        """The inner optimizer's state (the history is not in it; see state_dict)."""
        return self._inner.state

    @property
    def defaults(self) -> dict:
        return self._inner.defaults

    @property
    def options(self) -> dict:
        return dict(self._options)

    @property
    def placement(self) -> str:
        """Where the history lives: "device", "host" or "tiered"."""
        return self._history_placement

    # Reads of the C++ optimizer wait for its step and load too: a load replaces the
    # histories these read (a read beside it read freed memory: review finding).
    @property
    @_one_call_at_a_time
    def accepted(self) -> int:
        """Accelerated iterates the safeguard kept so far."""
        return self._aadl.accepted

    @property
    @_one_call_at_a_time
    def rejected(self) -> int:
        """Accelerated iterates the safeguard rejected so far (their loss was not lower)."""
        return self._aadl.rejected

    @_one_call_at_a_time
    def history_size(self, group: int = 0) -> int:
        """How many vectors the history of parameter group `group` holds."""
        return self._aadl.history_size(group)

    @_one_call_at_a_time
    def placement_stats(self, group: int = 0) -> dict:
        """What the placement of parameter group `group`'s history moved and holds, as
        Apollo.placement_stats() says it ("placement" is the C++ placement's name:
        resident, host_staged or tiered)."""
        return self._aadl.placement_stats(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    @_one_call_at_a_time
    def prefetch(self) -> None:
        """Starts loading the history the next step reads first. step() does this itself
        on entry; call it before the forward pass when that runs outside step(closure)."""
        self._aadl.prefetch()

    @_one_call_at_a_time
    def step(self, closure=None):
        """Steps the inner optimizer, then accelerates; returns the inner step's loss."""
        self._check_parameters()
        return self._aadl.step(closure)

    def _check_parameters(self) -> None:
        if not _name_the_same_parameters(self._inner.param_groups, self._params):
            raise RuntimeError("tidepool.optim.AADL: the inner optimizer's parameters changed "
                               "since this AADL was made; make a new one around it")

    @_one_call_at_a_time
    def _plain_step(self, closure=None):
        """The inner optimizer's step alone, with the checks step() makes (accelerate()'s
        step on a step GradScaler found overflowing)."""
        self._check_parameters()
        return self._inner_step(closure)

    @_one_call_at_a_time
    def state_dict(self) -> dict:
        """{'inner': the inner optimizer's state_dict(), 'aadl': the history and counters,
        as a 1-D uint8 tensor (torch.save keeps it as its own record, whatever its size)}."""
        return {"inner": self._inner.state_dict(), "aadl": self._aadl.save()}

    @_one_call_at_a_time
    def load_state_dict(self, state_dict) -> None:
        """Loads what state_dict() returned; if either part is refused, both the inner
        optimizer and the history stay as they were."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"inner", "aadl"}:
            raise ValueError("tidepool.optim.AADL: not an AADL state_dict (a dict with "
                             "'inner' and 'aadl')")
        saved = state_dict["aadl"]
        if isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.dim() == 1:
            saved = saved.detach().cpu().contiguous()  # map_location may have moved it
        elif isinstance(saved, (bytes, bytearray)):  # as versions before 2026-12-07 saved it
            saved = (torch.frombuffer(bytearray(saved), dtype=torch.uint8) if saved
                     else torch.empty(0, dtype=torch.uint8))  # frombuffer refuses nothing
        else:
            raise ValueError("tidepool.optim.AADL: the state_dict's 'aadl' is not a saved AADL "
                             "history (a 1-D uint8 tensor, or bytes)")
        previous = self._inner.state_dict()
        self._inner.load_state_dict(state_dict["inner"])
        try:
            self._aadl.load(saved)
        except BaseException:
            self._inner.load_state_dict(previous)
            raise

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"AADL({options}, history={self._history_placement!r},\n  {self._inner!r})"


def accelerate(optimizer, acceleration_type="anderson", relaxation=0.1, wait_iterations=1,
               history_depth=15, store_each_nth=1, frequency=1, reg_acc=0.0, *,
               history="host", history_budget=None) -> AADL:
    """As the reference's AADL.accelerate(optimizer, ...): from now on optimizer.step()
    (with or without a closure) is the accelerated step. Returns the AADL doing it, whose
    state_dict() is the one to save to resume with the history (optimizer.state_dict() is
    the inner optimizer's alone, as with the reference). LR schedulers made before or
    after work as with the plain optimizer. Accelerating an optimizer twice is refused;
    `del optimizer.step` undoes it (unless a scheduler wrapped it since)."""
    if _accelerated(vars(optimizer).get("step")) is not None:
        raise ValueError("tidepool.optim.accelerate: this optimizer is accelerated already")
    aadl = AADL(optimizer, acceleration_type, relaxation, wait_iterations, history_depth,
                store_each_nth, frequency, reg_acc, history=history,
                history_budget=history_budget)

    def accelerated_step(self, closure=None):
        # GradScaler steps an optimizer that unscales in its own step (fused Adam/AdamW:
        # _step_supports_amp_scaling) even when the gradients overflowed, with found_inf
        # set for it to skip the update. AADL must skip too: it would store the unchanged
        # iterate as a new one and extrapolate (review finding); the inner step skips.
        found_inf = getattr(self, "found_inf", None)
        if isinstance(found_inf, torch.Tensor) and bool(found_inf.item()):
            return aadl._plain_step(closure)
        return aadl.step(closure)
    accelerated_step._tidepool_accelerated = True
    # The instance-level step this replaces, which _InnerStep then calls: an LR scheduler
    # made earlier had wrapped the step to see it called. The scheduler checks that the
    # step it finds is still wrapped.
    replaced = vars(optimizer).get("step")
    accelerated_step._tidepool_replaced = replaced
    if getattr(replaced, "_wrapped_by_lr_sched", False):
        accelerated_step._wrapped_by_lr_sched = True
    # A method of the optimizer, as a scheduler made later expects to find (it rebinds
    # the function to the optimizer).
    optimizer.step = types.MethodType(accelerated_step, optimizer)
    # Weakly, as the optimizer itself (see _InnerStep): the step holds the AADL.
    aadl._inner_step.accelerated = weakref.ref(accelerated_step)
    return aadl


def _accelerated(step):
    """accelerate()'s step function when `step` (an optimizer's instance-level step) is
    it or wraps it (an LR scheduler's wrapper: functools.wraps keeps the wrapped
    function), else None."""
    func = getattr(step, "__func__", step)
    while func is not None:
        if getattr(func, "_tidepool_accelerated", False):
            return func
        func = getattr(func, "__wrapped__", None)
    return None


class _InnerStep:
    """The inner optimizer's own step, as AADL's C++ side calls it: its instance-level
    step (an LR scheduler's wrapper, which marks the optimizer stepped) or, where that is
    accelerate()'s, the one accelerate() replaced; else the class's. It holds the
    optimizer weakly: the binding's reference to it is invisible to Python's cycle
    collector, and accelerate() makes a cycle through it (optimizer -> step -> AADL ->
    binding -> this), which must stay collectable; the AADL object holds the optimizer
    strongly."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)
        # A weak reference to accelerate()'s step, when this AADL is the one it made.
        self.accelerated = None

    def __call__(self, closure=None):
        optimizer = self._optimizer()
        if optimizer is None:
            raise RuntimeError("tidepool.optim.AADL: the inner optimizer no longer exists")
        step = vars(optimizer).get("step")
        accelerated = _accelerated(step)
        if accelerated is None and self.accelerated is not None:
            # Review finding: a wrapper installed after accelerate() that does not name
            # what it wraps (__wrapped__; HF Accelerate's patch_optimizer_step) calls the
            # accelerated step, which called this, which called the wrapper again, without
            # end. The inner step of an accelerated optimizer is the one accelerate()
            # replaced, whatever wraps the accelerated step since.
            accelerated = self.accelerated()  # None once that step is gone
        if accelerated is not None:
            step = accelerated._tidepool_replaced
        if step is None:
            step = type(optimizer).step.__get__(optimizer)
        return step() if closure is None else step(closure)
