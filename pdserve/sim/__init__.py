"""Simulated accelerators (``--compute simulated``): a profile names a GPU, a model and the
coefficients of a roofline (profile.py); roofline.py turns a step's batch into seconds.
Pure Python, no torch: the router reads a profile to know the simulated model's identity
and KV shape, nodes to know how long each step sleeps. docs/simulation.md has the format."""
