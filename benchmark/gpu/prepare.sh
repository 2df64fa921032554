#!/usr/bin/env bash
# Here (registry access, the default model converted): what a GPU run carries, both git-ignored.
#   .gpu/       SGLang 0.5.23 for the GPU machine (../shared/gpu/build.sh)
#   .gpumodel/  SmolLM2-135M-Instruct's config and tokenizer, no weights: serve with
#               --load-format dummy (speed does not depend on weight values), and
#               qwen3-8b-shape/: the kit's Qwen3-8B-shaped config with the same tokenizer
#               (vocab_size set to it; positions up to 136K for the long-context runs).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -f .gpu/env.sh ] || bash ../shared/gpu/build.sh
src=$(.venv/bin/python -c "from sglang_sparse.default_model import ensure_default_model as e; print(e())" | tail -1)  # the first call also reports the conversion
mkdir -p .gpumodel/smollm2-135m
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$src/$f" .gpumodel/smollm2-135m/
done
mkdir -p .gpumodel/qwen3-8b-shape
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$src/$f" .gpumodel/qwen3-8b-shape/
done
.venv/bin/python - "$src" <<'PY'
import json, sys
cfg = json.load(open("../shared/gpu/qwen3-8b-shape.config.json"))
tok = json.load(open(sys.argv[1] + "/config.json"))
cfg["vocab_size"] = tok["vocab_size"]
cfg["max_position_embeddings"] = 139264
cfg["eos_token_id"] = tok.get("eos_token_id", cfg["eos_token_id"])
json.dump(cfg, open(".gpumodel/qwen3-8b-shape/config.json", "w"), indent=1)
PY
du -sh .gpu .gpumodel
