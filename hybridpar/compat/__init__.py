"""Bridges to torch: the torch internals and renamed functions hybridpar relies on, each in one place
(torch.py). fairscale's model-parallel state on a hybridpar mesh lives with the parallel layers
(hybridpar/parallel/fairscale.py)."""
