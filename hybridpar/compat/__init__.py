"""Bridges to other libraries: fairscale's model-parallel state on a hybridpar mesh (fairscale.py), and
the torch internals and renamed functions hybridpar relies on, each in one place (torch.py)."""
