"""Model-centric parallel recipes: parameter placements and the parallel ops, per model family.

A :class:`Recipe` (one per model family, in ``RECIPES``) holds an ordered list of
:class:`Rule` (first match wins) and names the parallel op for each seam of the model:
``sequence_attention`` (``ulysses`` or ``ring``), ``moe_dispatch`` (``all_to_all``),
``tensor`` (``megatron``) and ``pipeline`` (``gpipe``); ``config.parallel`` may override
an op by name. A rule gives, for every dimension of the matching parameter, the mesh axis
it is split over (or ``None``), or one of two shorthands: ``FSDP`` (split the largest
dimension divisible by the ZeRO group) and ``REPLICATE``. The same rules place the
optimizer state (its moments mirror the parameter paths) — MaxText's logical-axis rules and
VeOmni's parallel plans in one table. Switching layout is a change of ``config.mesh``: the
rules stay, axes of size 1 drop out.

ZeRO group (``Recipe.zero_axes``): the mesh axes that ``"fsdp"`` in a rule (and the ``FSDP``
shorthand) stands for. ``("fsdp",)`` shards parameters, gradients and Adam moments over the
``fsdp`` axis only; ``("fsdp", "expert", "sequence")`` (the ``omni_zero3`` recipe) shards
them over the whole data-parallel group — VeOmni treats sequence-parallel ranks as FSDP
ranks — and in a rule that already names one of those axes (routed experts over
``expert``) the others stand in (experts over ``expert`` x ``fsdp`` x ``sequence``, VeOmni's
EP x EP-FSDP). A dimension not divisible by the whole group is split over the longest
leading part of it that divides, and a note says so.

Per-module ZeRO groups (``Recipe.modules`` / ``Recipe.module_zero``): a recipe may name
parameter groups (:class:`Module`: a name and a path pattern, first match wins) and give a
group its own ZeRO group, over any mesh axes — e.g. the modality encoders FSDP over every
device (``data x fsdp x expert x sequence x tensor x pipeline``) while the backbone keeps
``zero_axes`` (the ``omni_enc_fsdp`` recipe). Parameters no group matches, and groups without
an entry, use ``zero_axes``. Where the encoders' *activations* go is a seam of its own
(``encoder_batch``: ``backbone`` leaves them where the batch is, ``all_devices`` spreads the
encoder batch over every device, :mod:`omni_jax.parallel.encoder_placement`).

:func:`resolve` turns rules into ``NamedSharding``s for a pytree and reports every place a
rule could not be applied as written (a dimension not divisible by its axis is kept whole),
so nothing is dropped silently.

The rules and their resolution live in :mod:`.rules`; :mod:`.omni` registers the omni model's
recipes.
"""

from omni_jax.parallel.recipes import omni as _omni  # noqa: F401  (registration)
from omni_jax.parallel.recipes.rules import (  # noqa: F401  (the package's API)
    FSDP,
    OP_CHOICES,
    RECIPES,
    REPLICATE,
    ZERO_AXES_ALLOWED,
    Module,
    Recipe,
    Rule,
    path_str,
    resolve,
)
