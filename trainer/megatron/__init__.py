"""miles_env.trainer.megatron: the megatron-core trainer backend, one module per concern.

backend (MegatronTrainer: the torch backend's step on a megatron-core GPTModel), convert
(HF <-> megatron weight names and shards), parallel (tp x pp x dp: stage models, 1F1B step,
grad reduction, gathers), cpu_shims (the monkeypatches that let megatron-core run on CPU over gloo,
quarantined here). Imported explicitly: `import miles_env.trainer.megatron` loads no megatron-core.
"""
