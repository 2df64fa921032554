"""``python -m sglang_sparse.launch_server [SGLang flags]``; see ``sglang_sparse.srt.launcher``."""

from sglang_sparse.srt.launcher import main

if __name__ == "__main__":
    main()
