"""Multi-turn, tool-using episodes: the episode handle, token-exact trajectories, tools.

Import the modules themselves (``from asyncrl.env.trajectory import Trajectory``); this package
imports nothing, so ``import asyncrl`` stays light.
"""
