"""miles_env.trainer: policy-gradient training on episodes drained from the replay queue.

Modules (imported explicitly, so `import miles_env.trainer` stays free of torch):
loop (TrainLoop / train_from_queue, the one take -> step -> checkpoint -> ack loop, its
`TrainerBackend` contract and the `StepHooks` a job plugs in), build (build_trainer: a backend by
name through a PluginTable), config (TrainerConfig), losses (pure GRPO/PPO/TIS/KL functions),
torch_backend (TorchTrainer: HF causal LM, one process or FSDP2 under torchrun), torch_checkpoint
(its checkpoints, one format for every world size), fsdp (its FSDP2 data parallelism), export (an
HF checkpoint folder, both backends' export_weights), samples (Sample, flatten_groups, StepMetrics: what a step consumes and
reports, shared with megatron), megatron/ (MegatronTrainer and its tp x pp x dp machinery), ranks (one trainer over torchrun ranks),
checkpoint (atomic rotating checkpoints), weight_delta (the delta format the engines import),
weight_sync (full and delta weight sync to an engine, in process or through disk).
"""
