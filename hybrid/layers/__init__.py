"""Layers of the hybrid: the head-level mixer, the branch fusion, and the baselines' mixers."""
