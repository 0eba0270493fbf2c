"""miles_env.trainer: policy-gradient training on episodes drained from the replay queue.

Modules (imported explicitly, so `import miles_env.trainer` stays free of torch):
config (TrainerConfig), losses (pure GRPO/PPO/TIS/KL functions), torch_backend
(TorchTrainer: HF causal LM, one process or FSDP2 under torchrun), checkpoint
(atomic rotating checkpoints), loop (train_from_queue: take -> step -> checkpoint -> ack).
"""
