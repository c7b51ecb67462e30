"""Liquid state machine (LSM) for spoken digits, after the FPGA LSM of ISCAS 2016.

Spoken digits are made by ``omni_jax.data.speech`` (espeak-ng / flite) and read by
``omni_jax.data.wav_folder`` (labelled WAV loader with input checks), shared with the audio
codec's example data. Modules: ``corpus`` (the voice split into tuning and held-out test voices,
spike encoding, folds, a test folder), ``ear`` (Lyon-style cochlear cascade + AGC + BSA spike
encoding), ``fixed_point`` (runtime-adjustable fixed-point formats), ``reservoir`` (LIF grid
built from k*exp(-D^2/r^2) and simulated with ``lax.scan``), ``readout`` (calcium-modulated
stochastic rule and a least-squares reference), ``power`` (operation/energy model with activity
gating), ``plots`` (raster and confusion PNGs), ``speed`` (our simulation speed against Brian2),
``brian2_env`` (an interpreter with Brian2: a venv made on first use) and ``brian2_peer`` (the
same reservoir in Brian2, run in that interpreter); ``study`` runs the experiment end to end
(what ``experiments.lsm`` calls).
"""
