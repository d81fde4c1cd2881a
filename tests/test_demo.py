"""The README's main job, `python -m msa_ops demo`: prefill and decode steps through the store, dense attention, the
indexer and sparse attention, each output checked against its own float64 computation, on each implementation."""

from __future__ import annotations

import re


def test_demo_passes_its_float64_check(impl, capsys):
    from msa_ops.demo import run_demo

    assert run_demo(steps=3, seed=0, implementation=impl) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out, out[-2000:]
    ran = dict(re.findall(r"^\s+(mo\.\S+)\s+-> (\w+)", out, re.M))
    assert len(ran) == 4 and set(ran.values()) == {impl}, ran
