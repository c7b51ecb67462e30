"""Learned discrete tokenizers: finite scalar quantisation (FSQ) codecs for images and audio."""
