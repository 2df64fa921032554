"""The HTTP process's side of SGLang's own generation routes (``/generate``, OpenAI)."""
