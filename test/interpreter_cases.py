"""Running Triton kernel cases under Triton's CPU interpreter, shared by the kernel test files.

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported, so every case of a
test file runs in *one* subprocess (``python <file> --interp``) with the variable set, and each
outcome is reported back to its own pytest test: ``interpreter_test(__file__, CASES)`` builds that
test (pytest side; ``results_of(file)`` runs the subprocess) and ``run_cases(cases, T)`` +
``report`` run and report the cases (subprocess side)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "INTERP-RESULTS "


class Unsupported(Exception):
    """The interpreter cannot run this case (the reason is reported as the skip reason)."""


def run_cases(cases: dict, T) -> dict:
    """Subprocess side: every case with its kernels namespace ``T``; outcome per case."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy inf arithmetic in masks
    out = {}
    for name, fn in cases.items():
        try:
            fn(T)
            out[name] = ["ok", ""]
        except Unsupported as exc:
            out[name] = ["skip", str(exc)]
        except Exception as exc:  # noqa: BLE001 - reported to the matching pytest test
            out[name] = ["fail", f"{type(exc).__name__}: {exc}"]
    return out


def report(results: dict) -> None:
    print(MARKER + json.dumps(results), flush=True)


def results_of(test_file: str) -> dict:
    """Pytest side: run ``test_file --interp`` under the interpreter, return its outcomes."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sgl-kernel-sparse" / "python"), str(ROOT / "python"),
                                         str(ROOT / "test"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, test_file, "--interp"], env=env, capture_output=True, text=True,
                         timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(MARKER)]
    assert res.returncode == 0 and lines, f"interpreter run failed:\n{res.stdout}\n{res.stderr}"
    return json.loads(lines[-1][len(MARKER):])


def interpreter_test(test_file: str, cases: dict):
    """The pytest test of a kernel file's interpreter cases: ``test_triton_interpreter =
    interpreter_test(__file__, CASES)``, one parametrized test per case. The subprocess runs once,
    at the first case; a failed run fails every case with its output."""
    outcome: dict = {}

    @pytest.mark.parametrize("case", sorted(cases))
    def test_triton_interpreter(case):
        if not outcome:
            try:
                outcome["results"] = results_of(test_file)
            except AssertionError as exc:
                outcome["error"] = str(exc)
        assert "error" not in outcome, outcome.get("error")
        status, msg = outcome["results"].get(case, ["fail", "case did not report"])
        if status == "skip":
            pytest.skip(msg)
        assert status == "ok", msg

    return test_triton_interpreter


def compile_report_rows(test_file: str, out: Path) -> list:
    """Pytest side of a kernel file's sm_90 compile check: run ``test_file --compile-report OUT``
    (the file's ``bench/compile_report.py`` compile, no GPU needed) and return its report rows;
    skip where this Triton's internals differ from what the tool drives (exit 3)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # must compile, not interpret
    res = subprocess.run([sys.executable, test_file, "--compile-report", str(out)], capture_output=True, text=True,
                         timeout=300, env=env)
    if res.returncode == 3 or (res.returncode and "ImportError" in res.stderr):
        pytest.skip(res.stderr.strip()[-300:])
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    return json.loads(Path(out).read_text())
