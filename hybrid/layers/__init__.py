"""Layers of the hybrid: the head-level mixer, the branch merge, and the baselines' mixers."""
