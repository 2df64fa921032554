"""Engine-agnostic core of sglang_sparse: torch and the standard library only, never ``sglang``.

The SGLang adapter (``sglang_sparse.srt``) is the only package that imports ``sglang``;
``test/test_import_rule.py`` enforces it.
"""
