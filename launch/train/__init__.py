"""Components of the GPT training job (`launch/pretrain_gpt.py`), one job per module:

* `arguments` — megatron's flag names, presets (the README's run among them), validation, the run's summary line;
* `datapath`, `tokenizer`, `indexed`, `corpus`, `data` — data: checks, tokenizers, indexed-dataset writing,
  the generated default corpus, megatron-core's GPTDataset and resumable step batches;
* `model` — TransformerConfig, GPTModel with our FP8 spec, DDP, distributed optimizer, LR schedule;
* `step` — one step on megatron's pipeline schedule inside the FP8 scope;
* `metrics` — FP8 health, per-role FP8 ranges, per-layer FP8 state, model FLOPs, peak memory, progress bar
  / log lines / TensorBoard / JSON lines;
* `fp8_roles` — the role (input, weight, grad) and layer name of each recorded FP8 tensor;
* `elastic` — torch.distributed start-up that survives torchrun's restarts;
* `children` — helper processes (megatron's checkpoint writer's) that die with their rank;
* `loop` — the job: start, resume, train, save.
"""
