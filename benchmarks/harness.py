"""Shared by the GPU benchmarks: device timing and writing results (JSON + markdown) into the output folder."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np


def bench(fn, args, iters: int = 20, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` runs of `iters` back-to-back calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts))


def in_graph(op, args, n: int = 10, more=()):
    """``(fn, fn_args)``: ``n`` calls of ``op(*args)`` inside one jitted function, for `bench` (per call: divide by n).

    Host dispatch of a jitted call costs tens of microseconds, as much as a small decode kernel runs, so one
    call per dispatch measures the host. Here one dispatch runs ``n`` independent calls. Every argument enters
    as ``n`` separate parameters (the same arrays each time, unless ``more`` is given), so XLA can neither merge the
    calls nor fuse them into one pass over a shared operand (with only q varied, the ten XLA attentions of a decode
    step shared K and V, and their figure exceeded the HBM peak). Each run of a jitted function also leaves a gap
    on the device (~25 us on an H100, NOTES_msa v55) that its n calls share: ten calls of ~50 us read ~5% slow from
    it, so small calls want a larger n. With ``more`` (argument tuples like ``args``), call i takes
    ``(args, *more)[i % (1 + len(more))]``: other selected blocks, say, so that a call does not find the bytes of
    the call before it in L2.
    """
    sets = (tuple(args), *map(tuple, more))
    k = len(args)
    assert all(len(a) == k for a in sets), "in_graph: every argument set of `more` must match `args`"

    def many(*params):
        return tuple(op(*params[i * k : (i + 1) * k]) for i in range(n))

    return jax.jit(many), tuple(a for i in range(n) for a in sets[i % len(sets)])


def bench_in_graph(op, args, n: int = 10, more=(), **kw) -> float:
    """Seconds per call of ``op(*args)``, timed as ``n`` calls inside one jitted function (`in_graph`)."""
    return bench(*in_graph(op, args, n, more), **kw) / n


def graph_timer(op, args, n: int = 10, more=(), **kw):
    """A function returning `bench_in_graph`'s seconds per call, compiled once (for `bench_rounds`); ``kw`` goes to
    `bench` (iters, repeats)."""
    fn, fn_args = in_graph(op, args, n, more)
    return lambda: bench(fn, fn_args, **kw) / n


def bench_rounds(timers: dict, rounds: int) -> dict:
    """{name: [seconds, one per round]}: each timer (a function returning seconds) called once a round, the order
    rotated from round to round. Figures compared with each other so come from the same stretch of the GPU's
    clocks and temperature: under load the H200 holds its 700 W cap by lowering its clock (1.7-1.98 GHz seen
    in one run), and a process's first timing of a call has read up to 8% faster than its later ones."""
    names = list(timers)
    got = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            got[n].append(timers[n]())
    return got


def round_ratios(num, den, scale: float = 1.0) -> tuple[float, list[float]]:
    """The median of the rounds' ratios scale * num[i] / den[i] (two `bench_rounds` series) and their [min, max]."""
    rel = scale * np.asarray(num, np.float64) / np.asarray(den, np.float64)
    return float(np.median(rel)), [float(rel.min()), float(rel.max())]


def write_results(out_dir: str, name: str, rows: list, text: str) -> None:
    """Print the markdown table and write `<name>.json` (rows) and `<name>.md` (text) into `out_dir`."""
    print(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write(text + "\n")
