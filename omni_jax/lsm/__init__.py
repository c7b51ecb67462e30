"""Liquid state machine (LSM) for spoken digits, after the FPGA LSM of ISCAS 2016.

Modules: ``speech`` (espeak-ng digit generation), ``wav_folder`` (labelled WAV loader with
input checks), ``ear`` (Lyon-style cochlear cascade + AGC + BSA spike encoding),
``fixed_point`` (runtime-adjustable fixed-point formats), ``reservoir`` (LIF grid built from
k*exp(-D^2/r^2) and simulated with ``lax.scan``), ``readout`` (calcium-modulated stochastic
rule and a least-squares reference), ``power`` (operation/energy model with activity
gating), ``plots`` (raster and confusion PNGs) and ``brian2_peer`` (the same reservoir in
Brian2, run in its own interpreter for the speed comparison); ``study`` runs the experiment
end to end (what ``experiments.lsm`` calls).
"""
