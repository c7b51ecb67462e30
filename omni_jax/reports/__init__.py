"""Reports about the main job: parallel layouts' bytes and gradients, encoder placement, the
scale plan, pipeline memory, the train step's breakdown, the input benchmark. Sits above
``train/`` and ``parallel/``; nothing below imports it."""
