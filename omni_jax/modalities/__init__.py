"""Modality kinds (encoders, sizes, synthetic data); importing registers the built-ins."""

from omni_jax.modalities import frames, patch, tokens, video  # noqa: F401  (registration)
from omni_jax.modalities.base import MODALITY_KINDS, ModalityKind, register_kind, resolve_spec

__all__ = ["MODALITY_KINDS", "ModalityKind", "register_kind", "resolve_spec"]
