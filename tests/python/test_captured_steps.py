"""Note [a step captured in a CUDA graph] (_captured_steps.py), on a machine without a GPU
(fake_tiering.py records the moves; torch.cuda.is_current_stream_capturing is made to
say whether a capture is in progress): a captured step gets no scope, no tag and no
move, and the state stays where it is; it is said once; the steps before and after the
capture are tiered as always."""

from __future__ import annotations

import warnings

import pytest
import torch

from tidepool import _captured_steps, _install, _step_scopes, _tags

from fake_tiering import EVICT, fake_tiering, prefetch_of  # noqa: F401  (a fixture)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records the tag each step runs under."""

    seen_tags: list = []

    def step(self, closure=None):
        RecordingAdamW.seen_tags.append(_tags.current())
        return super().step(closure)


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_a_captured_step_moves_nothing_and_the_steps_around_it_are_tiered(
        fake_cuda, fake_tiering, monkeypatch, mode):
    install(mode=mode, state_budget="1GiB")
    monkeypatch.setattr(_captured_steps, "_said", False)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    p = torch.nn.Parameter(torch.ones(8))
    optimizer = RecordingAdamW([p], lr=0.1)
    RecordingAdamW.seen_tags = []
    outside = _tags.current()

    def step():
        p.grad = torch.full((8,), 0.5)
        optimizer.step()

    step()  # the warm-up step: its state is made under optimizer_state and evicted
    assert fake_tiering == [EVICT]
    pool_events = len([c for c in fake_cuda if c[0] == "enter_pool"])
    capturing[0] = True
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step()
        step()
    assert fake_tiering == [EVICT], "a captured step moved state"
    assert RecordingAdamW.seen_tags[1:] == [outside, outside]
    assert _step_scopes._scopes() == []
    assert len([c for c in fake_cuda if c[0] == "enter_pool"]) == pool_events
    messages = [str(w.message) for w in said if issubclass(w.category,
                                                           _install.TidepoolInactiveWarning)]
    assert len(messages) == 1 and "captured in a CUDA graph" in messages[0]
    assert "tidepool.prefetch(optimizer)" in messages[0]
    capturing[0] = False
    fake_tiering.clear()
    step()
    assert fake_tiering == [prefetch_of(optimizer), EVICT]


def test_without_cuda_parameters_the_capture_is_not_asked_about(fake_cuda, monkeypatch):
    install()

    asked = []  # recorded, not raised: the production code catches what the check raises

    def no_cuda():
        asked.append(True)
        return False

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_cuda)
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    optimizer.step()
    assert asked == [], "asked whether a stream captures for a CPU-only optimizer"
