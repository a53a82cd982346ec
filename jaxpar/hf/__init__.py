"""Hugging Face checkpoints in and out, for jaxpar's Llama family (models/llama.py,
models/llama_moe.py): LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
Qwen3MoeForCausalLM.

- `config`: config.json <-> LlamaConfig / LlamaMoEConfig, the `--recipe hf:DIR` TrainConfig
- `names`: each parameter's Hugging Face tensors, and any slice of it assembled from theirs
- `tensors`: safetensors files read by checked slices (F32, BF16, F16) and written tensor by tensor
- `load`: a folder checked whole, then streamed onto a mesh's shardings (`jaxpar.from_hf`,
  `--init-from hf:DIR`)
- `save`: a checkpoint folder written atomically (`jaxpar export --format hf`)

docs/models.md, "Hugging Face checkpoints", is the user's guide.
"""
