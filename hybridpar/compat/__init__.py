"""Bridges that let code written for other model-parallel libraries run on a hybridpar mesh."""
