"""Gradient codecs: element-wise hop codecs for the ring (identity, INCEPTIONN, QSGD) and
linear compressors summed in the compressed domain (GradiVeQ, PowerSGD)."""
