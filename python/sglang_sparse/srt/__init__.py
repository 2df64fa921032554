"""The SGLang adapter: the only part of sglang_sparse that imports ``sglang``.

- ``plugin``: the entry point (group ``sglang.srt.plugins``) run in every SGLang process.
- ``platform``: what SGLang 0.5.23 needs to run on a CPU.
- ``status``: scheduler-side status (internal-state hook) and the ``/sparse/info`` route.
- ``launcher``: ``python -m sglang_sparse.launch_server``.
"""
