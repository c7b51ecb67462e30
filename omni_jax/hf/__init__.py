"""Hugging Face checkpoints in and out of the omni backbone (see docs/hf.md)."""
