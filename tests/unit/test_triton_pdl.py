"""Programmatic dependent launch (``layers/triton_pdl.py``): when it is used, and that a kernel compiled for
Hopper with ``USE_PDL`` carries the grid-dependency instructions (and without it carries none). The launches
themselves need a GPU: ``benchmarks/pdl_gpu.py`` checks on an H200 that the logits are the same bits either way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
from specserve.layers import triton_pdl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert triton_pdl.use_pdl(torch.device("cpu")) is False
    assert triton_pdl.pdl_args(torch.device("cpu")) == {"USE_PDL": False, "launch_pdl": False}
    # a CUDA device is refused before its capability is asked for (no GPU here)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_pdl.use_pdl(torch.device("cuda", 0)) is False
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("SPECSERVE_DISABLE_PDL", "1")
    assert triton_pdl.use_pdl(torch.device("cuda", 0)) is False
    monkeypatch.delenv("SPECSERVE_DISABLE_PDL")
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert triton_pdl.use_pdl(torch.device("cuda", 0)) is False


def test_on_for_hopper_only(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPECSERVE_DISABLE_PDL", raising=False)
    for major, expected in ((8, False), (9, True), (10, True)):
        monkeypatch.setattr(triton_pdl, "_capability_major", lambda index, m=major: m)
        assert triton_pdl.use_pdl(torch.device("cuda", 0)) is expected
        assert triton_pdl.pdl_args(torch.device("cuda", 0)) == {"USE_PDL": int(expected), "launch_pdl": expected}
    monkeypatch.setattr(triton_pdl, "EARLY_LAUNCH", True)  # mode 2: launch the next kernel, then wait
    assert triton_pdl.pdl_args(torch.device("cuda", 0)) == {"USE_PDL": 2, "launch_pdl": True}


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specserve.layers import triton_ops
sig = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "intermediate_size": "i32", "stride_in": "i32",
       "BLOCK": "constexpr", "USE_PDL": "constexpr"}
for mode in (0, 1, 2):
    src = ASTSource(triton_ops._silu_and_mul_kernel, sig, {"BLOCK": 1024, "USE_PDL": mode})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": mode > 0}).asm["ptx"]
    wait, launch, load = (ptx.find(s) for s in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                 "ld.global"))
    first, second = (wait, launch) if mode == 1 else (launch, wait)
    print(mode, ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"),
          int(0 <= first < second < load))
"""


def test_hopper_ptx_waits_and_launches_before_any_load(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions to compile
    result = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    counts = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in result.stdout.splitlines()}
    assert counts["0"] == (0, 0, 0)
    # one wait, then the dependents' launch (mode 2: the other way round), both before the first global load
    assert counts["1"] == (1, 1, 1) and counts["2"] == (1, 1, 1)
