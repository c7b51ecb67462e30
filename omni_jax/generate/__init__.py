"""Generation with the omni model: KV-cached prefill + constrained decoding (decode.py), the
decode-speed benchmark (bench.py), prompts and outputs of the generate job (job.py,
outputs.py). See docs/generation.md."""
