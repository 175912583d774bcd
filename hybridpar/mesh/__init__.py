"""The mesh and its ranks: `layout` (the rank arithmetic and the launcher's environment, torch-free),
`device` (the process groups of a DeviceMesh built on it) and `ranks` (cross-rank protocols: one rank
acts, every rank learns the outcome). Importing this package imports no torch."""
