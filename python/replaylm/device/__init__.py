"""The machine under the engine: which GPUs there are, and their set-up work done early."""
