"""omni_jax: a JAX research stack.

Areas (import them as ``omni_jax.<area>``): ``models`` and ``modalities`` (the omni-modal
MoE LLM), ``data``, ``train`` (the generic trainer), ``parallel`` and ``collectives``
(the only places that communicate), and the seed systems' own packages.
"""

__version__ = "0.1.0"
