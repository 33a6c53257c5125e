"""State a step makes under workspace is taken into tiering after it (Note [state made in
workspace steps] in _stray_state.py, Note [adopted state] in _adoption.py), on a machine
without a GPU (fake_tiering.py's placement: memory allocated under optimizer_state is a
range):
  - LBFGS's direction, last gradient and history lists, and the state of an optimizer
    that makes it anew each step, are copied into ranges before the eviction, and no bit
    of the trajectory changes; loaded LBFGS state is taken in through its lists;
  - what the copy keeps: named tuples, lists changed where they are, views sharing one
    storage sharing one copy, every bit of every dtype; never a parameter's or a
    gradient's memory, nor a tensor or storage something outside the state holds (said
    once); a state entry that is a tensor itself;
  - when it looks: an optimizer that updates its state in place is trusted after two
    steps that could show otherwise (not a state step, not one without gradients for
    state large enough to tier), and
    looked through again at doubling intervals; Adagrad's constructor-made state is taken
    in at its first step;
  - a copy that fails is said, and neither fails the step nor loses state;
  - the published AADL's history, which no hook sees, is pointed out once."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch

from tidepool import _adoption, _in_flight, _install, _stray_state, _tags

import per_parameter
from fake_tiering import EVICT, fake_tiering, state_tensors, untiered_state  # noqa: F401
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)

MIN_BYTES = 64  # tidepool.tier_min_bytes in these tests: a 32-float vector is tiered


@pytest.fixture
def looks(monkeypatch) -> list:
    """The looks through optimizer state after steps (_adoption.stray_state calls), each
    as the number of optimizers looked through."""
    seen: list = []
    real_stray_state = _adoption.stray_state
    monkeypatch.setattr(_adoption, "stray_state",
                        lambda optimizers, **options: seen.append(len(optimizers)) or
                        real_stray_state(optimizers, **options))
    return seen


def remove_hooks() -> None:
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None


def lbfgs_problem(flat: bool):
    """Parameters (one vector, or two tensors) and the closure of a least-squares problem."""
    torch.manual_seed(0)
    a, b = torch.randn(48, 32), torch.randn(48)
    if flat:
        params = [torch.nn.Parameter(torch.zeros(32))]
    else:
        params = [torch.nn.Parameter(torch.zeros(16)), torch.nn.Parameter(torch.zeros(16))]

    def make_closure(optimizer):
        def closure():
            optimizer.zero_grad()
            x = torch.cat([p.reshape(-1) for p in params])
            loss = ((a @ x - b) ** 2).mean()
            loss.backward()
            return loss
        return closure

    return params, make_closure


def run_lbfgs(flat: bool, steps: int, after_step=None):
    params, make_closure = lbfgs_problem(flat)
    optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4)
    closure = make_closure(optimizer)
    losses = []
    for _ in range(steps):
        losses.append(optimizer.step(closure).item())
        if after_step is not None:
            after_step(optimizer)
    return [p.detach().clone() for p in params], losses


@pytest.mark.parametrize("mode", ["global", "pool"])
@pytest.mark.parametrize("flat", [True, False], ids=["one_vector", "two_tensors"])
def test_lbfgs_state_is_taken_into_tiering_after_every_step(fake_cuda, fake_tiering,
                                                            untiered_state, mode, flat):
    plain_params, plain_losses = run_lbfgs(flat, steps=6)
    install(mode=mode, tier_min_bytes=str(MIN_BYTES))
    seen = []

    def after_step(optimizer):
        state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        tensors = state_tensors(state, MIN_BYTES)
        # d, prev_flat_grad and the history vectors: all in ranges, none left behind.
        assert len(tensors) >= 2 + min(len(seen), 1) * 2
        assert all(untiered_state.tiered(t) for t in tensors)
        assert fake_tiering[-1] == EVICT  # the copies are evicted with the rest
        seen.append(len(untiered_state.adopted_under))
        fake_tiering.clear()

    before = _adoption.stats(0)["hooks.state_adopted_after_step_bytes"]
    params, losses = run_lbfgs(flat, steps=6, after_step=after_step)
    assert set(untiered_state.adopted_under) == {_tags.OPTIMIZER_STATE}
    # tidepool.stats() counts what was copied: at least a direction per later step.
    assert _adoption.stats(0)["hooks.state_adopted_after_step_bytes"] - before >= 5 * 32 * 4
    # The steps after the first make state under workspace every time (a step with two
    # tensors makes its first state under optimizer_state: the second has no entry yet).
    assert all(later > earlier for earlier, later in zip(seen[1:], seen[2:]))
    assert losses == plain_losses
    assert all(torch.equal(p, q) for p, q in zip(params, plain_params)), "no bit changes"


class PerParameter(per_parameter.PerParameter):
    """The test optimizers below (lr and beta in their groups)."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})


class RenewingMomentum(PerParameter):
    """Momentum SGD that makes its state anew each step (state["m"] = beta * m + g), and
    keeps the last two gradients as a tuple: what an optimizer written without in-place
    ops does."""

    def update(self, group, p):
        state = self.state[p]
        m = state.get("m")
        m = p.grad.clone() if m is None else group["beta"] * m + p.grad
        last = state.get("last", (torch.zeros_like(p), torch.zeros_like(p)))
        state["m"] = m
        state["last"] = (last[1], p.grad.clone())
        p.sub_(group["lr"] * (m + 0.5 * last[0]))


def run_renewing(steps: int, after_step=None):
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(32))
    optimizer = RenewingMomentum([p])
    for i in range(steps):
        p.grad = torch.randn(32) * (i + 1)
        optimizer.step()
        if after_step is not None:
            after_step(optimizer, p)
    return p.detach().clone()


def test_state_made_anew_each_step_is_taken_in_each_step(fake_cuda, fake_tiering, untiered_state):
    plain = run_renewing(steps=5)
    install(tier_min_bytes=str(MIN_BYTES))
    adopted = []

    def after_step(optimizer, p):
        state = optimizer.state[p]
        assert isinstance(state["last"], tuple)
        assert all(untiered_state.tiered(t) for t in state_tensors(state, MIN_BYTES))
        adopted.append(len(untiered_state.adopted_under))

    result = run_renewing(steps=5, after_step=after_step)
    # The first step makes m and `last` under optimizer_state; each later one makes m
    # and a new gradient copy in `last` under workspace: two copies per step.
    assert adopted == [0, 2, 4, 6, 8]
    assert torch.equal(result, plain)


def test_named_tuples_in_the_state_are_rebuilt_as_named_tuples(fake_cuda, fake_tiering,
                                                              untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    pair = collections.namedtuple("pair", "first second")
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = torch.optim.SGD([p], lr=0.1)
    small = torch.ones(2)
    optimizer.state[p] = {"pair": pair(torch.ones(32), small), "n": 3,
                          "lists": [[torch.full((32,), 2.0)], {"x": torch.full((32,), 3.0)}]}
    inner_list = optimizer.state[p]["lists"]
    stray = _adoption.stray_state([optimizer])
    assert len(stray) == 3
    before = _adoption.stats(0)
    assert _adoption.adopt_stray_state([optimizer], [0], stray, "on_load") == 3 * 32 * 4
    after = _adoption.stats(0)
    assert after["hooks.state_adopted_on_load_bytes"] - \
        before["hooks.state_adopted_on_load_bytes"] == 3 * 32 * 4
    assert after["hooks.num_state_adoptions"] == before["hooks.num_state_adoptions"] + 1
    state = optimizer.state[p]
    assert type(state["pair"]) is pair and state["pair"].second is small  # under MIN_BYTES
    assert torch.equal(state["pair"].first, torch.ones(32))
    assert state["lists"] is inner_list, "a list is changed where it is"
    assert all(untiered_state.tiered(t) for t in state_tensors(state, MIN_BYTES))
    assert state["n"] == 3
    assert len(_adoption.stray_state([optimizer])) == 0


def test_an_optimizer_updating_its_state_in_place_is_looked_through_twice(
        fake_cuda, fake_tiering, untiered_state, looks):
    install(tier_min_bytes=str(MIN_BYTES))
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(32))
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    for _ in range(5):
        p.grad = torch.randn(32)
        optimizer.step()
    # The first step makes the state under optimizer_state (a look after it shows
    # nothing); the next two, under workspace, vouch: trusted from then on.
    assert looks == [1, 1, 1]
    assert untiered_state.adopted_under == []
    assert untiered_state.tiered(optimizer.state[p]["exp_avg"])


def test_an_optimizer_once_found_renewing_is_looked_through_after_every_step(
        fake_cuda, fake_tiering, untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = RenewingMomentum([p])
    for _ in range(4):
        p.grad = torch.ones(32)
        optimizer.step()
    assert _stray_state._record(optimizer).clean == 0


def test_loaded_lbfgs_state_is_taken_in_through_its_lists(fake_cuda, fake_tiering, untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    params, make_closure = lbfgs_problem(flat=True)
    optimizer = torch.optim.LBFGS(params, lr=0.5, max_iter=3, history_size=4)
    closure = make_closure(optimizer)
    for _ in range(3):
        optimizer.step(closure)
    checkpoint = copy.deepcopy(optimizer.state_dict())  # what torch.load gives: not tiered
    saved = state_tensors(checkpoint["state"][0], MIN_BYTES)
    assert saved and not any(untiered_state.tiered(t) for t in saved)
    fake_tiering.clear()
    untiered_state.adopted_under.clear()
    optimizer.load_state_dict(checkpoint)
    state = optimizer.state[params[0]]
    assert len(state["old_dirs"]) == len(checkpoint["state"][0]["old_dirs"]) > 0
    assert all(untiered_state.tiered(t) for t in state_tensors(state, MIN_BYTES))
    assert len(untiered_state.adopted_under) == len(saved)
    assert fake_tiering == [EVICT]
    for loaded, original in zip(state_tensors(state, MIN_BYTES), saved):
        assert torch.equal(loaded, original)


def test_without_the_hooks_nothing_is_taken_in(fake_cuda, fake_tiering, untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    remove_hooks()
    run_lbfgs(flat=True, steps=3)
    assert untiered_state.adopted_under == []


class ViewKeeping(PerParameter):
    """Keeps, besides momentum made anew each step, a view of its parameter and the
    gradient itself (memory that is the parameter's and the gradient's), and two moments
    that are rows of one buffer, with a small view of the first (sharing a storage)."""

    def update(self, group, p):
        state = self.state[p]
        state["flat"] = p.view(-1)
        state["grad"] = p.grad
        rows = torch.stack([p.grad, p.grad * 2]) + state.get("rows", 0)
        state["rows"] = rows
        state["first"], state["second"], state["head"] = rows[0], rows[1], rows[0, :2]
        p.sub_(group["lr"] * state["first"])


def test_views_of_parameters_are_never_copied_and_shared_storages_stay_shared(
        fake_cuda, fake_tiering, untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = ViewKeeping([p])
    for i in range(3):
        p.grad = torch.full((32,), float(i + 1))
        optimizer.step()
        state = optimizer.state[p]
        # The parameter's own memory stays what the optimizer holds: a copy would make
        # the optimizer's updates through it go nowhere.
        assert state["flat"].data_ptr() == p.data_ptr()
        assert state["grad"] is p.grad
        shared = {state[k].untyped_storage().data_ptr()
                  for k in ("rows", "first", "second", "head")}
        assert len(shared) == 1, "views of one storage stay views of one storage"
        assert untiered_state.tiered(state["rows"]) and untiered_state.tiered(state["head"])
        assert state["second"].storage_offset() == 32 and state["head"].size() == (2,)
        state["first"][0] = 100.0  # still a view: the buffer sees it
        assert state["rows"][0, 0] == 100.0 and state["head"][0] == 100.0
        state["first"][0] = state["rows"][0, 1]
    # Adopted from the second step on: the first made its state under optimizer_state.
    assert len(untiered_state.adopted_under) == 2, "each storage copied once per step"


class SharingOutside(PerParameter):
    """Makes its momentum m anew each step, and a row of a new buffer; keeps on itself,
    besides, what `share` says: m itself, a view of m, or the buffer's other row."""

    def __init__(self, params, share: str):
        super().__init__(params)
        self.share = share
        self.kept = None

    def update(self, group, p):
        state = self.state[p]
        m = p.grad + 0.5 * state.get("m", 0)
        buffer = torch.stack([m, m * 2])
        state["m"], state["row"] = m, buffer[1]
        self.kept = {"tensor": m, "view": m[:4], "sibling": buffer[0]}[self.share]
        p.sub_(group["lr"] * m)


@pytest.mark.parametrize("share, left", [("tensor", "m"), ("view", "m"), ("sibling", "row")])
def test_state_something_else_holds_too_is_left_where_it_is(fake_cuda, fake_tiering,
                                                            untiered_state, share, left,
                                                            monkeypatch):
    monkeypatch.setattr(_stray_state, "_warned", set())
    install(tier_min_bytes=str(MIN_BYTES))
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = SharingOutside([p], share)
    taken = "row" if left == "m" else "m"
    with pytest.warns(_install.TidepoolInactiveWarning, match="SharingOutside") as warned:
        for step in range(3):
            p.grad = torch.ones(32)
            optimizer.step()
            state = optimizer.state[p]
            if step == 0:  # made under optimizer_state: in ranges where it was made
                continue
            # Both holders keep one tensor, or one storage: a copy would part them.
            assert optimizer.kept.untyped_storage().data_ptr() == \
                state[left].untyped_storage().data_ptr()
            assert not untiered_state.tiered(state[left])
            assert untiered_state.tiered(state[taken]), "what the state alone holds is taken in"
    assert len([w for w in warned if "SharingOutside" in str(w.message)]) == 1, "said once"


@pytest.mark.parametrize("grads", [
    # a parameter's first gradient comes late: its step makes state under optimizer_state,
    # so the other's renewed buffer lands in a range too, and a look shows nothing
    [(True, False), (True, True), (True, True), (True, True)],
    # steps in which no parameter had a gradient update no state
    [(True, True), (False, False), (False, False), (True, True), (True, True)],
], ids=["late_gradient", "no_gradients"])
def test_only_steps_that_could_show_renewed_state_count_towards_trust(
        fake_cuda, fake_tiering, untiered_state, grads):
    install(tier_min_bytes=str(MIN_BYTES))
    params = [torch.nn.Parameter(torch.zeros(32)), torch.nn.Parameter(torch.zeros(32))]
    optimizer = RenewingMomentum(params)
    for step in grads:
        for p, has in zip(params, step):
            p.grad = torch.ones(32) if has else None
        optimizer.step()
    # The last step renewed both buffers under workspace: taken in, not trusted away.
    for p in params:
        assert untiered_state.tiered(optimizer.state[p]["m"])
    assert _stray_state._record(optimizer).clean == 0


def test_steps_that_renew_only_state_too_small_to_tier_do_not_count_towards_trust(
        fake_cuda, fake_tiering, untiered_state):
    """Steps with gradients for the small parameters only (their state under
    tier_min_bytes, never tiered) show nothing a look could find: were they counted, the
    optimizer would be trusted and the large state its next step renews left out (found
    by test_optim_hooks_random.py with TIDEPOOL_TEST_SEED=2401)."""
    install(tier_min_bytes=str(MIN_BYTES))
    small, large = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(32))
    optimizer = RenewingMomentum([small, large])
    for has_large in (True, False, False, False, True):
        small.grad = torch.ones(2)
        large.grad = torch.ones(32) if has_large else None
        optimizer.step()
    assert untiered_state.tiered(optimizer.state[large]["m"]), "the renewed state was left out"
    assert _stray_state._record(optimizer).clean == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64, torch.uint8, torch.bool, torch.complex64,
                                   torch.complex128])
def test_the_adoptions_copy_is_bit_for_bit(fake_cuda, dtype):
    # What _adopt_tensor copies with (a kernel, not the copy engine) keeps every bit: -0.0
    # and NaN payloads, and the strides of a transposed tensor.
    install()
    source = torch.arange(24, dtype=torch.float64).reshape(4, 6).to(dtype)
    if dtype.is_floating_point:
        source[0, 0], source[0, 1] = -0.0, float("nan")
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[source.element_size()]
        source.view(bits)[0, 2] = source.view(bits)[0, 1] ^ 1  # another NaN payload
    views = [source, source.t()]
    if dtype.is_complex:
        views.append(source.conj())  # a lazy view: its bits are not its values
    for value in views:
        copy = _adoption._adopt_tensor(value)
        assert torch.equal(copy, value) or dtype.is_floating_point  # (NaN != NaN)
        assert copy.data_ptr() != value.data_ptr() and copy.stride() == value.stride()
        assert copy.dtype == value.dtype and copy.shape == value.shape
        assert bytes(copy.resolve_conj().contiguous().view(torch.uint8).flatten().tolist()) == \
            bytes(value.resolve_conj().contiguous().view(torch.uint8).flatten().tolist())


class TensorEntries(PerParameter):
    """Keeps each parameter's momentum as its state entry itself (state[p] is a tensor,
    not a dict), updated in place."""

    def update(self, group, p):
        buf = self.state.get(p)
        if buf is None:
            self.state[p] = buf = p.grad.clone()
        else:
            buf.mul_(group["beta"]).add_(p.grad)
        p.sub_(group["lr"] * buf)


def test_a_state_entry_that_is_a_tensor_is_state(fake_cuda, fake_tiering, untiered_state):
    # A tensor's truth value is an error for several elements: the hooks must not ask it.
    def run():
        torch.manual_seed(3)
        p = torch.nn.Parameter(torch.zeros(32))
        optimizer = TensorEntries([p])
        for _ in range(4):
            p.grad = torch.randn(32)
            optimizer.step()
        return p.detach().clone(), optimizer
    plain, _ = run()
    install(tier_min_bytes=str(MIN_BYTES))
    hooked, optimizer = run()
    assert torch.equal(hooked, plain)
    (entry,) = optimizer.state.values()
    assert untiered_state.tiered(entry)  # made by the first step, under optimizer_state
    assert untiered_state.adopted_under == []


class RenewsLater(PerParameter):
    """Momentum updated in place until step `renew_from`, made anew each step after."""

    def __init__(self, params, renew_from: int):
        super().__init__(params)
        self.renew_from = renew_from
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)

    def update(self, group, p):
        state = self.state[p]
        m = state.get("m")
        if m is None:
            state["m"] = m = p.grad.clone()
        elif self.steps >= self.renew_from:
            state["m"] = m = group["beta"] * m + p.grad
        else:
            m.mul_(group["beta"]).add_(p.grad)
        p.sub_(group["lr"] * m)


def test_a_trusted_optimizer_is_looked_through_again_now_and_then(fake_cuda, fake_tiering,
                                                                  untiered_state):
    install(tier_min_bytes=str(MIN_BYTES))
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = RenewsLater([p], renew_from=6)
    trusted_after = 3  # the state step, then two workspace steps that updated state
    relook = trusted_after + _stray_state._FIRST_RELOOK
    for step in range(1, relook + 3):
        p.grad = torch.ones(32)
        optimizer.step()
        clean = _stray_state._record(optimizer).clean
        if trusted_after <= step < relook:
            assert clean == _stray_state._CLEAN_LOOKS_TO_TRUST
        tiered = untiered_state.tiered(optimizer.state[p]["m"])
        # Renewed from step 6 on, under workspace: resident until the look after `relook`,
        # taken in after every step from then on.
        assert tiered == (step < 6 or step >= relook), f"step {step}"
    assert _stray_state._record(optimizer).clean == 0


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_a_trusted_optimizer_whose_step_leaves_workspace_bytes_alive_is_looked_at_once(
        fake_cuda, fake_tiering, untiered_state, monkeypatch, mode):
    """Note [workspace growth]: in global mode, bytes alive under workspace after a
    trusted optimizer's step that were not before it make the look come at once; in pool
    mode (workspace steps allocate outside tidepool) the re-looks remain. Tensors on this
    machine do not go through tidepool, so the renewal counts its bytes here itself."""
    install(tier_min_bytes=str(MIN_BYTES), mode=mode)
    assert isinstance(_stray_state._workspace_bytes(0), int)  # tidepool's per-tag stats
    alive = {0: 0}
    monkeypatch.setattr(_stray_state, "_workspace_bytes", lambda device: alive.get(device))

    class CountedRenewal(RenewsLater):
        def update(self, group, p):
            if self.steps >= self.renew_from:
                alive[0] += p.numel() * p.element_size()  # the new buffer, made under workspace
            super().update(group, p)

    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = CountedRenewal([p], renew_from=6)
    for step in range(1, 9):
        p.grad = torch.ones(32)
        optimizer.step()
        tiered = untiered_state.tiered(optimizer.state[p]["m"])
        assert tiered == (step < 6 or mode == "global"), f"step {step}"


def test_relooks_come_twice_as_far_apart_each_time_up_to_a_limit(fake_cuda):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    record = _stray_state._record(optimizer)
    _stray_state._start_relooks(record)
    due = [step for step in range(1, 5000) if _stray_state._relook_due(record)]
    first = _stray_state._FIRST_RELOOK
    gaps = [b - a for a, b in zip([0] + due, due)]
    assert gaps[:3] == [first, 2 * first, 4 * first]
    assert max(gaps) == _stray_state._LAST_RELOOK and gaps[-1] == _stray_state._LAST_RELOOK


def test_state_made_once_outside_a_step_is_taken_in_and_the_optimizer_trusted_after(
        fake_cuda, fake_tiering, untiered_state, looks):
    # torch's Adagrad makes its state in __init__, outside any step: its first step finds
    # it outside tiering and takes it in; the steps after update it in place.
    install(tier_min_bytes=str(MIN_BYTES))
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = torch.optim.Adagrad([p], lr=0.1)
    assert not untiered_state.tiered(optimizer.state[p]["sum"])
    for _ in range(6):
        p.grad = torch.ones(32)
        optimizer.step()
        assert untiered_state.tiered(optimizer.state[p]["sum"])
    assert untiered_state.adopted_under == [_tags.OPTIMIZER_STATE]
    assert looks == [1, 1, 1], "taken in at the first step, trusted after two more"


def test_a_copy_that_fails_is_said_and_the_step_goes_on(fake_cuda, fake_tiering,
                                                       untiered_state, monkeypatch):
    # The update is done when the post-hook copies: a failed copy must not fail the step
    # nor lose state; the next step's look tries again.
    monkeypatch.setattr(_stray_state, "_warned", set())
    plain = run_renewing(steps=5)
    install(tier_min_bytes=str(MIN_BYTES))
    real_adopt = _adoption._adopt_tensor
    calls = []

    def failing_once(value):
        calls.append(1)
        if len(calls) == 2:  # the second copy of the second step
            raise RuntimeError("out of memory (test)")
        return real_adopt(value)

    monkeypatch.setattr(_adoption, "_adopt_tensor", failing_once)
    outside = _tags.current()
    tiered_after = []
    with pytest.warns(_install.TidepoolInactiveWarning, match="out of memory") as warned:
        result = run_renewing(steps=5, after_step=lambda optimizer, p: tiered_after.append(
            all(untiered_state.tiered(t) for t in state_tensors(optimizer.state[p], MIN_BYTES))))
    assert torch.equal(result, plain), "no state lost, no bit changed"
    assert tiered_after == [True, False, True, True, True], "the next look took it in"
    assert len([w for w in warned if "out of memory" in str(w.message)]) == 1
    assert _tags.current() == outside and _in_flight.in_flight() == {}, "every scope closed"


def test_the_published_aadls_history_on_the_device_is_pointed_out_once(
        fake_cuda, fake_tiering, untiered_state, monkeypatch):
    """The published AADL.accelerate keeps its history in optimizer.acc_param_hist,
    appended after the step it wraps: no hook tiers it, and the pre-step hook says once
    where tidepool.optim.accelerate would keep it (_untiered_history.py). Meta tensors
    stand for device memory here; a history in host memory is not pointed out."""
    from tidepool import _untiered_history
    install(tier_min_bytes=str(MIN_BYTES))
    monkeypatch.setattr(_untiered_history, "_said", False)

    def accelerate(optimizer, device):  # the published AADL's way, reduced to the history
        optimizer.acc_param_hist = [collections.deque(maxlen=3) for _ in optimizer.param_groups]
        optimizer.orig_step = optimizer.step

        def accelerated_step(self, closure=None):
            self.orig_step(closure)
            for group, hist in zip(self.param_groups, self.acc_param_hist):
                hist.append(torch.cat([p.detach().reshape(-1) for p in group["params"]])
                            .to(device))
        optimizer.step = accelerated_step.__get__(optimizer)

    def steps(device, count):
        params = [torch.nn.Parameter(torch.ones(8))]
        optimizer = torch.optim.SGD(params, lr=0.1)
        accelerate(optimizer, device)
        for _ in range(count):
            optimizer.zero_grad()
            params[0].square().sum().backward()
            optimizer.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        steps("cpu", 3)  # in host memory: nothing to say
        with pytest.warns(_install.TidepoolInactiveWarning,
                          match=r"acc_param_hist: 1 vector, 0\.0 MiB on meta\).*"
                                r"tidepool\.optim\.accelerate"):
            steps("meta", 3)  # said at the second step's pre-hook, the history holding one
        steps("meta", 3)  # once per process


def sparse_embedding_run(make_optimizer, steps: int):
    """An nn.Embedding(sparse=True) trained `steps` steps: its weight, its optimizer."""
    torch.manual_seed(3)
    embedding = torch.nn.Embedding(40, 8, sparse=True)
    optimizer = make_optimizer(embedding.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        embedding(torch.tensor([step % 40, (3 * step) % 40, 7])).pow(2).sum().backward()
        optimizer.step()
    return embedding.weight.detach().clone(), optimizer


SPARSE_OPTIMIZERS = {
    # The momentum buffer is grad.clone(): a sparse tensor in the state.
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    # Dense state made in the constructor (stray at the first step), beside a sparse grad.
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


@pytest.mark.parametrize("budget", ["0", "1MiB"])  # 1 MiB: the steps prefetch by pointer
@pytest.mark.parametrize("mode", ["global", "pool"])
@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_sparse_gradients_and_sparse_state_are_left_where_they_are(
        fake_cuda, fake_tiering, untiered_state, mode, name, budget):
    """A sparse tensor has no storage to name or move: the hooks leave it (and the step)
    alone, where they tier the dense rest; state_dict and load_state_dict work."""
    make = SPARSE_OPTIMIZERS[name]
    plain_weight, _ = sparse_embedding_run(make, steps=4)
    install(mode=mode, tier_min_bytes=str(MIN_BYTES), state_budget=budget)
    weight, optimizer = sparse_embedding_run(make, steps=4)
    assert torch.equal(weight, plain_weight)
    state = next(iter(optimizer.state.values()))
    if name == "sgd_momentum":
        assert state["momentum_buffer"].is_sparse
    else:
        assert untiered_state.tiered(state["sum"])  # taken in at its first step
        if budget != "0":  # and named by pointer before the later steps
            assert any(move[0] == "prefetch" and move[2] for move in fake_tiering)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    optimizer.step()  # the gradient of the last step, again
