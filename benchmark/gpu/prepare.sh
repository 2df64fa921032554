#!/usr/bin/env bash
# Here (registry access, the default model converted): what a GPU run carries, both git-ignored.
#   .gpu/       SGLang 0.5.23 for the GPU machine (../shared/gpu/build.sh)
#   .gpumodel/  SmolLM2-135M-Instruct's config and tokenizer, no weights: serve with
#               --load-format dummy (speed does not depend on weight values).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .gpu/env.sh ] || bash ../shared/gpu/build.sh
src=$(.venv/bin/python -c "from sglang_sparse.default_model import ensure_default_model as e; print(e())")
mkdir -p .gpumodel/smollm2-135m
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$src/$f" .gpumodel/smollm2-135m/
done
du -sh .gpu .gpumodel
