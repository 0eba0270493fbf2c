"""miles_env.trainer.megatron: the megatron-core trainer backend, one module per concern.

backend (MegatronTrainer: the torch backend's step on a megatron-core GPTModel), convert
(HF <-> megatron weight names and tensor-parallel shards), experts (MoE layers and their
expert-parallel shards), layout (tp x pp x cp x ep x dp checked at load), parallel (stage models,
the pipeline schedule, the weight gather), batches (a rank's microbatches: fillers, one shape),
grads (gradient reductions and the norm), context (context parallelism: GPU + TransformerEngine
only), cpu_shims (the monkeypatches that let megatron-core run on CPU over gloo, quarantined here).
Imported explicitly: `import miles_env.trainer.megatron` loads no megatron-core.
"""
