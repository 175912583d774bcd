"""Checkpoints: sharded DCP save/resume, Meta consolidated and Hugging Face formats."""
