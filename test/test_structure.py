"""The shape of the package, read from its source (no SGLang needed):

- no import circle anywhere in ``sglang_sparse`` (every import counts, also inside functions);
- only ``srt/plugin.py`` calls SGLang's registration functions, and every entry of the patch
  inventory names a handler that exists;
- ``srt/`` keeps its mutable state in the one typed ``STATE`` object (no other module-level
  mutable value, no ``global``), and sets no attribute on SGLang objects but ``req.sparse``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python" / "sglang_sparse"
SRT = PKG / "srt"
REGISTRARS = {"register", "register_attention_backend", "add_attention_backend_choices",
              "register_radix_cache_backend", "add_api_route", "add_exception_handler", "add_middleware"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _in_type_checking(node, parents) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path) -> set[str]:
    """sglang_sparse modules a file imports (``from a import b`` counts ``a.b`` when it is a module)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("sglang_sparse")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("sglang_sparse"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (PKG.parent / Path(*sub.split(".")) / "__init__.py").exists() else base)
    return out - {me}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PKG.rglob("*.py")}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_cycle_finder_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_package():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            owner = ast.unparse(fn.value) if isinstance(fn, ast.Attribute) else ""
            yield name, owner, node


def test_only_the_plugin_registers_with_sglang():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path == SRT / "plugin.py":
            continue
        for name, owner, node in _calls(path):
            if name in REGISTRARS and (name != "register" or "HookRegistry" in owner):
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {owner}.{name}")
    assert offenders == []


def test_every_inventory_entry_is_complete():
    from sglang_sparse.srt.inventory import HOOK_KINDS, LISTED_KINDS, PATCHES

    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    kinds = set(HOOK_KINDS) | set(LISTED_KINDS) | {"module-state", "model-rebuild", "attention-backend",
                                                   "radix-backend", "route", "exception-handler"}
    for p in PATCHES:
        assert p.kind in kinds and p.why and p.target, p
        assert p.process in ("all", "main", "scheduler") and p.when in (
            "cpu", "active", "evicting", "flat_kv_pool", "payload_pool", "chain_cache", "engine_probe", "projects_kv",
            "check_integrity"), p
        if p.kind in LISTED_KINDS:
            assert not p.handler and (not p.applied_by or p.applied_by in names), p
            continue
        module, attr = p.handler.split(":")
        if module == "engine.attention_triton":
            continue  # CUDA only
        assert callable(getattr(importlib.import_module(f"sglang_sparse.srt.{module}"), attr)), p


MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "count", "ContextVar", "Counter", "OrderedDict"}


def _module_level_mutables(path: Path, root: Path = PKG) -> list[str]:
    """Module-level names bound to a mutable value, and ``global`` statements."""
    out = []
    tree = ast.parse(path.read_text())
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            name = ast.unparse(t)
            if name == "STATE" and path.name == "state.py":
                continue
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
            if isinstance(value, ast.Call):
                fn = value.func
                mutable = (fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")) in MUTABLE_CALLS
            if mutable:
                out.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.append(f"{path.relative_to(root)}:{node.lineno} global {', '.join(node.names)}")
    return out


def test_srt_keeps_its_state_in_one_typed_object():
    offenders = [o for p in SRT.rglob("*.py") for o in _module_level_mutables(p)]
    assert offenders == []


def test_detectors_see_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("X = {}\ny = list()\nC = (1, 2)\ndef f():\n    global y\n    req.sparse_x = 1\n")
    assert _module_level_mutables(probe, tmp_path) == ["probe.py:1 X", "probe.py:2 y", "probe.py:5 global y"]
    assert _sglang_attributes(probe, tmp_path) == ["probe.py:6 req.sparse_x"]


def _sglang_attributes(path: Path, root: Path = PKG) -> list[str]:
    """Attribute assignments that invent a field on an object: ``x.sparse_*`` / ``x._sparse*``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for elt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(elt, ast.Attribute) and (elt.attr.startswith(("sparse_", "_sparse"))):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(elt)}")
    return out


def test_no_attribute_on_sglang_objects_but_req_sparse():
    offenders = [o for p in SRT.rglob("*.py") for o in _sglang_attributes(p)]
    assert offenders == []


def test_req_sparse_is_the_typed_request_state():
    state = importlib.import_module("sglang_sparse.srt.state")

    class Req:
        pass

    req = Req()
    st = state.sparse(req)
    assert isinstance(st, state.ReqSparse) and req.sparse is st and state.sparse(req) is st
