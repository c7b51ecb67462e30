"""Example data made on the machine: the real-files example manifest (photos, spoken vowels,
clips) and the held-out image / audio sets the learned codecs are scored on."""
