#!/usr/bin/env python3
"""tidepool.optim (Apollo, AADL through the Python binding) on one device, in every
placement: the trajectories must be bitwise the same wherever the state lives; the time
per step and the device memory each placement takes are printed beside each other, and
on a GPU each off-device placement's time against its floor: the resident step's time or
its bytes moved at the link rate measured in the same run, whichever is longer.

    scripts/optim_checks.py [--device cuda|cpu] [--layers N] [--width W] [--steps S]

Prints one line per optimizer and placement, then "optim <name> PASS|FAIL"; exits 1 when
a placement changed a result. Run alone for its times (scripts/device-check runs it after
the side-by-side checks; the test suite runs it small on the CPU, tests/python/
test_optim.py). Needs the environment the Python tests have (PYTHONPATH=python/src,
TIDEPOOL_LIBRARY, TIDEPOOL_OPTIM_MODULE), or the installed package.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import tidepool.optim as topt


def model_and_batch(args, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    for layer in layers:
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / args.width ** 0.5)
            layer.bias.zero_()
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    x = torch.randn(64, args.width, generator=gen)
    return model.to(args.device), x.to(args.device)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def moved_bytes(stats: dict) -> int:
    return stats.get("bytes_to_device", 0) + stats.get("bytes_to_host", 0)


def run(args, make, placement: str):
    """(parameters after the run, seconds per step after the first, device peak bytes
    beyond the model (None on the CPU, but for tiered state: its store's peak), bytes moved
    per step after the first, the placement's stats).

    Every row's peak is measured the same way: torch's peak over the run beyond the model
    (gradients, activations, and state kept on the device), plus, for tiered state, whose
    device buffers come from tidepool's allocator rather than torch's, the tiered store's
    own peak (an upper bound: the two peaks need not fall together). The time and the
    bytes moved per step both leave the first step out (it records the schedule)."""
    model, x = model_and_batch(args)
    opt = make(model.parameters(), placement)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if args.device == "cuda" else 0
    times = []
    moved_after_first = 0
    for step in range(args.steps):
        synchronize(args.device)
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
        if step == 0:
            moved_after_first = moved_bytes(opt.placement_stats())
    # On the CPU torch has no device peak: None (printed as not measured), and a tiered
    # row's figure is its store's peak on the host backend alone.
    peak = torch.cuda.max_memory_allocated() - base if args.device == "cuda" else None
    stats = opt.placement_stats()
    if stats.get("placement") == "tiered":
        peak = (peak or 0) + stats["device_peak_bytes"]
    params = [p.detach().cpu() for p in model.parameters()]
    steps_after_first = max(1, len(times) - 1)
    per_step = sum(times[1:]) / steps_after_first
    moved = (moved_bytes(stats) - moved_after_first) / steps_after_first
    return params, per_step, peak, moved, stats


def link_rate(device: str) -> float | None:
    """Bytes per second over the host link with both directions busy at once (pinned
    copies of 256 MiB on two streams), measured in this run; None without a GPU."""
    if device != "cuda":
        return None
    n = 256 << 20
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def both_ways(times: int) -> None:
        for _ in range(times):
            with torch.cuda.stream(streams[0]):
                dev[0].copy_(host[0], non_blocking=True)
            with torch.cuda.stream(streams[1]):
                host[1].copy_(dev[1], non_blocking=True)
    both_ways(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    both_ways(4)
    torch.cuda.synchronize()
    return 2 * 4 * n / (time.perf_counter() - start)


def check(args, name, make, placements, rate) -> bool:
    results = {p: run(args, make, p) for p in placements}
    first = results[placements[0]][0]
    same = all(all(torch.equal(a, b) for a, b in zip(first, r[0])) for r in results.values())
    resident = results["device"][1]
    for placement, (_, per_step, peak, moved, stats) in results.items():
        # What this placement could take at best: the resident step, or moving its bytes
        # at the link rate of this run, whichever is longer.
        floor = ""
        if rate and placement != "device":
            best = max(resident, moved / rate)
            floor = f"  floor {best * 1e3:.2f} ms/step, {per_step / best:.2f}x"
        if peak is None:
            memory = "device peak not measured (CPU)"
        elif args.device != "cuda":
            memory = f"store's device peak on the host backend {peak / 2**20:9.1f} MiB"
        else:
            memory = f"device peak beyond the model {peak / 2**20:9.1f} MiB"
        print(f"optim {name:<6} {placement:<7} {per_step * 1e3:9.2f} ms/step  {memory}  "
              f"moved {moved / 2**20:9.1f} MiB/step ({stats.get('placement')}){floor}",
              flush=True)
    print(f"optim {name:<6} {'PASS' if same else 'FAIL'}  trajectories bitwise equal across "
          f"{', '.join(placements)}: {same}", flush=True)
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    n = args.layers * (args.width + 1) * args.width
    state = 3 * n * 4
    budget = max(state // 4, 3 * 4 * (args.width + 1) * args.width)  # a quarter, >= a layer
    print(f"optim: {args.device}, {n / 1e6:.1f} M fp32 parameters, {args.steps} steps; "
          f"Apollo state {state / 2**20:.0f} MiB, tiered budget {budget / 2**20:.0f} MiB; "
          f"AADL history 5 vectors ({5 * n * 4 / 2**20:.0f} MiB), tiered budget 64 MiB",
          flush=True)

    def apollo(params, placement):
        return topt.Apollo(params, lr=0.01, warmup=2, state=placement,
                           state_budget=budget if placement == "tiered" else None)

    def aadl(params, placement):
        return topt.AADL(torch.optim.SGD(params, lr=0.05), relaxation=0.5, history_depth=5,
                         history=placement,
                         history_budget=64 << 20 if placement == "tiered" else None)

    try:
        rate = link_rate(args.device)
    except RuntimeError as error:  # the checks go on; only the floors are lost
        print(f"optim: the link rate could not be measured: {error}", flush=True)
        rate = None
    if rate:
        print(f"optim: link {rate / 1e9:.1f} GB/s with both directions busy (pinned, "
              f"measured here)", flush=True)
    ok = check(args, "apollo", apollo, ["device", "host", "tiered"], rate)
    ok &= check(args, "aadl", aadl, ["device", "host", "tiered"], rate)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
