"""Visage: timely 3D analytics for drone imagery (overlap graph, local 3D, prioritised upload)."""
