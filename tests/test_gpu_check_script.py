"""`scripts/gpu_check.sh`'s dealt steps, run here with a stand-in for Python whose `-m pytest` prints what a part
would: the dealing (large-pool tests in the first part, the others over every part; GPU_EVERY's sample), each part's
share of the cores (not a caller's OpenMP count), the total line, and a step that fails when a part's last line is
not a pass (an error beside passes counts)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# The stand-in: `--collect-only` lists 13 ids (3 large-pool ones); a run writes one line per id to $FAKE_LOG with
# its part's thread counts and its process id, then ends as pytest -q does, or with an error beside the passes if it
# ran $FAKE_BAD_ID.
FAKE = r'''#!PYTHON
import os, sys
args = sys.argv[1:]
if "--collect-only" in args:
    for i in range(10):
        print(f"tests/test_gpu.py::test_x[{i}]")
    for i in range(3):
        print(f"tests/test_large_pool.py::test_big[{i}]")
    print("13 tests collected")
    sys.exit(0)
ids = [a for a in args if "::" in a]
with open(os.environ["FAKE_LOG"], "a") as f:
    for i in ids:
        f.write(f"{i} {os.environ.get('OPENBLAS_NUM_THREADS')} {os.environ.get('MSA_OPS_NUM_THREADS')} "
                f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')} {os.getpid()}\n")
bad = sum(i == os.environ.get("FAKE_BAD_ID") for i in ids)
print("=== slowest 10 durations ===")
print(f"0.50s call     {ids[0]}")
print("")
print(f"{len(ids) - bad} passed, {bad} error in 0.10s" if bad else f"{len(ids)} passed in 0.10s")
'''


def cores():
    """What `nproc` prints with no OpenMP variable set: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.fixture
def fake_py(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    py = tmp_path / "fakepy"
    py.write_text(FAKE.replace("PYTHON", sys.executable, 1))
    py.chmod(0o755)
    return py


def run_script(tmp_path, fake_py, **env_extra):
    out = tmp_path / "out"
    log = tmp_path / "calls.txt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MSA_OPS_NUM_THREADS")}
    env.update(OUT=str(out), PY=str(fake_py), STEPS="gpu", PACK="0", FAKE_LOG=str(log), BUILD=str(tmp_path / "b"))
    env.update(env_extra)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    return (out / "pytest_gpu.log").read_text(), r.stdout, calls


def test_dealt_gpu_step_shares_cores_and_totals(tmp_path, fake_py):
    log, stdout, calls = run_script(tmp_path, fake_py, GPU_PROCS="3")
    assert "13 tests over 3 processes" in log
    assert "all parts: 13 passed, 0 failed or errors" in log, log
    assert sorted(c[0] for c in calls) == sorted([f"tests/test_gpu.py::test_x[{i}]" for i in range(10)]
                                                 + [f"tests/test_large_pool.py::test_big[{i}]" for i in range(3)])
    share = str(max(1, cores() // 3))
    assert all(c[1] == share and c[2] == share and c[3] == "false" for c in calls), calls
    # The large-pool ids all go to the first part (no two at once); the other ten are dealt in turn over all three
    # parts, the first taking its turn last: 3 + 3 ids there, 4 and 3 in the others.
    parts = {}
    for c in calls:
        parts.setdefault(c[4], []).append(c[0])
    assert sorted(len(p) for p in parts.values()) == [3, 4, 6], parts
    big = [p for p in parts.values() if any("test_large_pool" in i for i in p)]
    assert len(big) == 1 and sum("test_large_pool" in i for i in big[0]) == 3, parts
    part0 = log.split("== ")[1]
    assert "gpu_0.part" in part0 and "6 passed" in part0, log
    assert "| pytest_gpu | rc=0" in stdout, stdout


def test_gpu_every_samples_and_caller_threads_win(tmp_path, fake_py):
    log, _, calls = run_script(tmp_path, fake_py, GPU_EVERY="4", OPENBLAS_NUM_THREADS="7")
    # Every 4th of the 13 collected ids (the 1st, 5th, 9th, 13th), in one process.
    assert "4 tests over 1 processes" in log and "all parts: 4 passed" in log, log
    assert [c[0] for c in calls] == ["tests/test_gpu.py::test_x[0]", "tests/test_gpu.py::test_x[4]",
                                     "tests/test_gpu.py::test_x[8]", "tests/test_large_pool.py::test_big[2]"]
    assert all(c[1] == "7" for c in calls), calls  # the caller's count is kept
    assert all(c[2] == str(cores()) for c in calls), calls


def test_a_callers_openmp_count_is_not_taken_for_the_cores(tmp_path, fake_py):
    # GNU nproc prints OMP_NUM_THREADS where it is set; the shares of the other counts still come from the cores.
    _, _, calls = run_script(tmp_path, fake_py, GPU_PROCS="2", OMP_NUM_THREADS="64")
    share = str(max(1, cores() // 2))
    assert len(calls) == 13 and all(c[1] == share and c[2] == share for c in calls), calls


def test_a_part_with_an_error_fails_the_step(tmp_path, fake_py):
    log, stdout, _ = run_script(tmp_path, fake_py, GPU_PROCS="3", FAKE_BAD_ID="tests/test_gpu.py::test_x[3]")
    assert "all parts: 12 passed, 1 failed or errors" in log, log
    assert "| pytest_gpu | rc=1" in stdout, stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
