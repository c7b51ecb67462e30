"""DPAD: screen-recaptured document detection with FMAG and M2FM.

Modules: ``documents`` (synthetic print pages), ``recapture`` (jitted physical screen ->
camera simulator), ``fmag`` (moiré-preserving spectral augmentation), ``models`` (flax
ResNet / ViT / M2FM reconstructor), ``train`` (patch training and scoring),
``pad_metrics`` (APCER, BPCER, EER, AUC, bootstrap intervals over images and seeds),
``spectrum`` (image-only period, sharpness and noise estimates), ``shortcut`` (trivial
one-feature classifiers), ``plots`` (figures), ``study`` (the experiment end to end, what
``experiments.dpad`` runs).
"""
