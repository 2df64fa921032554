"""The engine-agnostic core must not import SGLang; only ``sglang_sparse.srt`` may."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python" / "sglang_sparse"
ADAPTER = PKG / "srt"


def sglang_imports(path: Path) -> list[str]:
    """Module names starting with ``sglang`` (not ``sglang_sparse``) imported anywhere in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [n for n in names if n == "sglang" or n.startswith("sglang.")]
    return found


def test_detector_sees_sglang_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom sglang.srt import x\ndef f():\n    import sglang\nimport sglang_sparse\n")
    assert sglang_imports(probe) == ["sglang.srt", "sglang"]


def test_only_the_adapter_imports_sglang():
    offenders = {
        str(p.relative_to(PKG)): mods
        for p in PKG.rglob("*.py")
        if ADAPTER not in p.parents and (mods := sglang_imports(p))
    }
    # launch_server.py only re-exports the adapter's launcher; it names no sglang module.
    assert offenders == {}, f"engine-agnostic modules import sglang: {offenders}"


def test_engine_agnostic_modules_do_not_load_sglang():
    code = (
        "import sys, importlib, pkgutil\n"
        "for pkg in ('core', 'methods', 'kernels'):\n"
        "    mod = importlib.import_module('sglang_sparse.' + pkg)\n"
        "    for m in pkgutil.walk_packages(mod.__path__, mod.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "import sglang_sparse.registry, sglang_sparse.default_model, sglang_sparse.server_process\n"
        "assert sglang_sparse.registry.method_names()\n"
        "bad = sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
