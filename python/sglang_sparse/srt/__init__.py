"""The SGLang adapter: the only part of sglang_sparse that imports ``sglang``.

Subsystems (``docs/architecture.md`` has one sentence per module):

- ``plugin`` + ``inventory``: the entry point and the table of everything changed in SGLang;
- ``state``: the one typed state object (``STATE``) and ``req.sparse``;
- ``engine/``: attention backends, forward-step hooks, rows vs logical, admission, KV store;
- ``cache/``: the logical radix cache binding and the slot census;
- ``chains/``, ``prune/``: Chain Cache and prefix pruning, each a scheduler side and an HTTP side;
- ``admin/``: typed admin operations between the HTTP process and the schedulers;
- ``api/``: checks on SGLang's own generation routes;
- ``status``, ``metrics``: what the extension reports; ``launcher``, ``platform``, ``activation``.
"""
