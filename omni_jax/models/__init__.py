"""Pure functional models: layers, attention, MoE, the transformer backbone, omni model."""
