"""Thin adapters for the training frameworks users hand a loader to (docs/frameworks.md).

Each submodule imports its framework when it is imported itself, never before: nothing in the
core imports `tierflow.integrations`, and `import tierflow` needs none of them. Install them
with the `frameworks` extra (`pip install 'tierflow[frameworks]'`).

- `tierflow.integrations.lightning`: the Loader returned by `train_dataloader()` works as is;
  `LoaderStateCallback` keeps the saved state that of the trained batch when Lightning fetches
  one batch ahead (a Loader without `len()`).
- `tierflow.integrations.transformers`: `TierflowTrainer` (the `Trainer` over a Loader, its state
  in `checkpoint-N/`), `LoaderCheckpointCallback`, `hf_batch` (Hugging Face labels).
- `tierflow.integrations.accelerate`: `register_for_checkpointing` recipe and its checks.
- `tierflow.integrations.litgpt`: `TierflowDataModule`, (B, L+1) token tensors for Fabric.
- `tierflow.integrations.torchtitan`: `TierflowDataLoader`, torchtitan's `BaseDataLoader`.
- `tierflow.integrations.dataloader`: `LoaderDataLoader`, a `torch.utils.data.DataLoader` that
  delegates to a Loader, for frameworks that accept nothing else (Fabric).
"""
